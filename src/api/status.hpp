// Internal status: a code from the C ABI plus a message naming the argument and the rule.
#pragma once

#include <string>
#include <utility>

#include "flashcore/flashcore.h"

namespace flashcore {

struct Status {
  fc_status code = FC_OK;
  std::string message;

  static Status ok() { return {}; }
  static Status invalid(std::string msg) { return {FC_ERROR_INVALID_ARGUMENT, std::move(msg)}; }
  static Status unsupported(std::string msg) { return {FC_ERROR_UNSUPPORTED, std::move(msg)}; }
  static Status cuda(std::string msg) { return {FC_ERROR_CUDA, std::move(msg)}; }
  static Status internal(std::string msg) { return {FC_ERROR_INTERNAL, std::move(msg)}; }
  bool is_ok() const { return code == FC_OK; }
};

}  // namespace flashcore
