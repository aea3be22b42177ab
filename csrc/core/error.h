// Typed errors of the C++ core.
//
// Every failure leaves the core as a gpucoll::Error carrying a code, a message for the user, the failing
// call (e.g. "shm_open(/gpucoll-...)" or "ncclAllReduce") and where it was raised. csrc/python/ translates
// it once into the matching gpucoll.errors class. Library code never calls exit() or abort(), and
// destructors and teardown paths never throw.
#pragma once

#include <exception>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace gpucoll {

enum class ErrorCode : int {
  kInvalidArgument = 1,  // the caller passed something wrong (names the argument and what was expected)
  kUnsupported = 2,      // valid request this build/backend/library version cannot do
  kInvalidUsage = 3,     // wrong state: closed communicator, call outside a group, ...
  kTimeout = 4,          // a collective or rendezvous did not complete in time (ranks() lists who was missing)
  kRemote = 5,           // another rank failed (ranks() lists which)
  kNccl = 6,             // NCCL returned an error (message holds ncclGetErrorString / ncclGetLastError)
  kCuda = 7,             // CUDA runtime/driver error
  kSystem = 8,           // an OS call failed (message holds strerror)
  kInternal = 9,         // a gpucoll bug
};

const char* error_code_name(ErrorCode code);

class Error : public std::exception {
 public:
  Error(ErrorCode code, std::string message, std::string call = {}, const char* file = nullptr, int line = 0,
        std::vector<int> ranks = {});

  ErrorCode code() const noexcept { return code_; }
  const std::string& message() const noexcept { return message_; }
  const std::string& call() const noexcept { return call_; }
  // "file.cc:123", or empty.
  const std::string& location() const noexcept { return location_; }
  // Ranks the error is about: missing ranks for kTimeout, failed ranks for kRemote.
  const std::vector<int>& ranks() const noexcept { return ranks_; }
  const char* what() const noexcept override { return what_.c_str(); }

 private:
  ErrorCode code_;
  std::string message_;
  std::string call_;
  std::string location_;
  std::vector<int> ranks_;
  std::string what_;
};

namespace detail {
template <class... Args>
std::string concat(Args&&... args) {
  std::ostringstream os;
  (os << ... << std::forward<Args>(args));
  return os.str();
}
}  // namespace detail

// Raise with file:line of the throw site.
#define GPUCOLL_THROW(code, call, ...) \
  throw ::gpucoll::Error((code), ::gpucoll::detail::concat(__VA_ARGS__), (call), __FILE__, __LINE__)

#define GPUCOLL_INVALID_ARG(...) GPUCOLL_THROW(::gpucoll::ErrorCode::kInvalidArgument, "", __VA_ARGS__)

#define GPUCOLL_CHECK_ARG(cond, ...)  \
  do {                                \
    if (!(cond)) {                    \
      GPUCOLL_INVALID_ARG(__VA_ARGS__); \
    }                                 \
  } while (0)

#define GPUCOLL_INTERNAL_CHECK(cond)                                                             \
  do {                                                                                           \
    if (!(cond)) {                                                                               \
      GPUCOLL_THROW(::gpucoll::ErrorCode::kInternal, "", "internal check failed: " #cond);       \
    }                                                                                            \
  } while (0)

// errno-setting OS calls: throws kSystem naming the call and strerror(errno).
[[noreturn]] void throw_system_error(const std::string& call, int err, const char* file, int line);
#define GPUCOLL_SYSCALL_FAIL(call, err) ::gpucoll::throw_system_error((call), (err), __FILE__, __LINE__)

}  // namespace gpucoll
