// The shared-memory region of one host's ranks: an anonymous file (memfd) that has no name anywhere.
//
// Rank 0 creates it and keeps its descriptor open until every rank has attached; the others open it through
// /proc/<rank 0's pid>/fd/<fd>, a path each builds itself from two integers it got through the rendezvous, and
// check that the file belongs to their own user. Nothing is ever linked in /dev/shm, so no kill timing can
// leave a segment behind: the memory lives exactly as long as some rank maps it. (A named POSIX segment had a
// window, from creation until the last rank attached and unlinked it, in which a SIGKILLed job leaked it.)
// No Python resource tracker is involved (FACTS.md: Python's shared_memory unlinks segments on attachers' exit).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace gpucoll::host {

// What an attaching rank needs: the creator's pid and descriptor (the /proc path is built from them locally)
// and the random token in the region's header.
struct ShmHandle {
  int64_t pid = 0;
  int64_t fd = -1;
  uint64_t token[2] = {0, 0};
};

class ShmRegion {
 public:
  ShmRegion() = default;
  ~ShmRegion();
  ShmRegion(const ShmRegion&) = delete;
  ShmRegion& operator=(const ShmRegion&) = delete;

  // Create and size a zero-filled region (memfd_create, ftruncate, mmap) and draw its token; throws kSystem
  // naming the call on failure.
  void create(size_t bytes);
  // Map the region of `h`; throws kSystem (open, fstat, mmap) or kInvalidArgument (a malformed handle, not a
  // regular file of this user) naming /proc/<pid>/fd/<fd>. The caller checks the header and the token.
  void attach(const ShmHandle& h);
  // The creator's descriptor is no longer needed once every rank has attached; idempotent, never throws.
  void close_fd() noexcept;
  void unmap() noexcept;

  void* data() const { return data_; }
  size_t size() const { return size_; }
  // The creator's handle (pid, fd, token); fd is -1 once close_fd() ran, and on a rank that attached.
  ShmHandle handle() const { return handle_; }
  const std::string& describe() const { return what_; }

 private:
  void* data_ = nullptr;
  size_t size_ = 0;
  int fd_ = -1;
  ShmHandle handle_;
  std::string what_ = "(no region)";
};

}  // namespace gpucoll::host
