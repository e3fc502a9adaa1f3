// `flashcore`: run (the main job), bench (a grid with a table / JSON / CSV), info (build and devices).
#include <cstdio>
#include <cstring>
#include <exception>
#include <string>

#include "common.hpp"

namespace flashcore::cli {
int command_run(int argc, char** argv);
int command_bench(int argc, char** argv);

int command_info() {
  std::printf("%s\n", fc_build_info());
  const int n = fc_cuda_device_count();
  std::printf("  cuda devices: %d\n", n);
  for (int d = 0; d < n; ++d) {
    char line[256];
    if (fc_cuda_device_describe(d, line, sizeof(line)) == FC_OK) std::printf("    %d: %s\n", d, line);
    else std::printf("    %d: (%s)\n", d, fc_last_error());
  }
  for (int b = FC_BACKEND_CPU_REFERENCE; b <= FC_BACKEND_CUDA_SM90; ++b)
    std::printf("  backend %-14s %s\n", fc_backend_name(b), fc_backend_available(b, 0) ? "available" : "not available");
  return 0;
}
}  // namespace flashcore::cli

static void usage(FILE* f) {
  std::fprintf(f,
               "usage: flashcore <command> [options]\n\n"
               "commands:\n"
               "  run     compute attention on the best backend present, check it, report time and memory\n"
               "  bench   benchmark a grid of shapes (table, --json FILE, --csv FILE)\n"
               "  info    build configuration, backends and devices\n\n"
               "`flashcore <command> --help` lists a command's options.\n");
}

int main(int argc, char** argv) {
  if (argc < 2 || !std::strcmp(argv[1], "--help") || !std::strcmp(argv[1], "-h")) {
    usage(argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  const std::string cmd = argv[1];
  try {
    if (cmd == "run") return flashcore::cli::command_run(argc, argv);
    if (cmd == "bench") return flashcore::cli::command_bench(argc, argv);
    if (cmd == "info") return flashcore::cli::command_info();
    std::fprintf(stderr, "flashcore: unknown command '%s'\n\n", cmd.c_str());
    usage(stderr);
    return 2;
  } catch (const flashcore::cli::UsageError& e) {
    std::fprintf(stderr, "flashcore %s: %s\n(see `flashcore %s --help`)\n", cmd.c_str(), e.what(), cmd.c_str());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "flashcore %s: error: %s\n", cmd.c_str(), e.what());
    return 1;
  }
}
