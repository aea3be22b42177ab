// A POSIX shared-memory region shared by the ranks of one host (shm_open + mmap, mode 0600).
//
// Rank 0 creates it under a random name, the other ranks attach by that name (exchanged through the
// rendezvous store), and the name is unlinked as soon as every rank has attached: from then on the mapping
// lives exactly as long as the processes do, so a crash leaves nothing behind in /dev/shm. No Python
// resource tracker is involved (FACTS.md: Python's shared_memory unlinks segments on attachers' exit).
#pragma once

#include <cstddef>
#include <string>

namespace gpucoll::host {

class ShmRegion {
 public:
  ShmRegion() = default;
  ~ShmRegion();
  ShmRegion(const ShmRegion&) = delete;
  ShmRegion& operator=(const ShmRegion&) = delete;

  // A fresh, unguessable name: "/gpucoll-<pid>-<random>".
  static std::string make_name();
  // Create (O_EXCL) and size a zero-filled region; throws kSystem naming the call on failure.
  void create(const std::string& name, size_t bytes);
  // Attach to an existing region; its size is read from the file.
  void attach(const std::string& name);
  // Remove the name; idempotent, never throws (ENOENT is fine: another rank got there first).
  void unlink() noexcept;
  void unmap() noexcept;

  void* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& name() const { return name_; }
  bool linked() const { return linked_; }

 private:
  void* data_ = nullptr;
  size_t size_ = 0;
  std::string name_;
  bool linked_ = false;
};

}  // namespace gpucoll::host
