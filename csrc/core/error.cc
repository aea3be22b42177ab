#include "core/error.h"

#include <cstring>

namespace gpucoll {

const char* error_code_name(ErrorCode code) {
  switch (code) {
    case ErrorCode::kInvalidArgument:
      return "InvalidArgument";
    case ErrorCode::kUnsupported:
      return "Unsupported";
    case ErrorCode::kInvalidUsage:
      return "InvalidUsage";
    case ErrorCode::kTimeout:
      return "CollectiveTimeout";
    case ErrorCode::kRemote:
      return "RemoteError";
    case ErrorCode::kNccl:
      return "NcclError";
    case ErrorCode::kCuda:
      return "CudaError";
    case ErrorCode::kSystem:
      return "SystemError";
    case ErrorCode::kInternal:
      return "InternalError";
  }
  return "GpucollError";
}

static std::string basename_of(const char* file) {
  if (file == nullptr) return {};
  const char* slash = std::strrchr(file, '/');
  // Keep the directory inside csrc/ ("backends/host/shm.cc") - enough to find the file.
  const char* csrc = std::strstr(file, "csrc/");
  if (csrc != nullptr) return csrc + 5;
  return slash ? slash + 1 : file;
}

Error::Error(ErrorCode code, std::string message, std::string call, const char* file, int line,
             std::vector<int> ranks)
    : code_(code), message_(std::move(message)), call_(std::move(call)), ranks_(std::move(ranks)) {
  if (file != nullptr) location_ = basename_of(file) + ":" + std::to_string(line);
  what_ = message_;
  if (!call_.empty()) what_ += " [call: " + call_ + "]";
  if (!location_.empty()) what_ += " [at " + location_ + "]";
}

void throw_system_error(const std::string& call, int err, const char* file, int line) {
  char buf[256];
  // GNU strerror_r may return a static string instead of filling buf.
  const char* text = strerror_r(err, buf, sizeof(buf));
  throw Error(ErrorCode::kSystem, call + " failed: " + text + " (errno " + std::to_string(err) + ")", call, file,
              line);
}

}  // namespace gpucoll
