#include "backends/host/shm.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <random>

#include "core/error.h"

namespace gpucoll::host {

ShmRegion::~ShmRegion() {
  unlink();
  unmap();
}

std::string ShmRegion::make_name() {
  std::random_device rd;
  const uint64_t r = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  char buf[64];
  std::snprintf(buf, sizeof(buf), "/gpucoll-%d-%016llx", static_cast<int>(getpid()),
                static_cast<unsigned long long>(r));
  return buf;
}

void ShmRegion::create(const std::string& name, size_t bytes) {
  const int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) GPUCOLL_SYSCALL_FAIL("shm_open(" + name + ", O_CREAT|O_EXCL)", errno);
  name_ = name;
  linked_ = true;
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    const int err = errno;
    close(fd);
    unlink();
    GPUCOLL_SYSCALL_FAIL("ftruncate(" + name + ", " + std::to_string(bytes) + ")", err);
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int err = errno;
  close(fd);
  if (p == MAP_FAILED) {
    unlink();
    GPUCOLL_SYSCALL_FAIL("mmap(" + name + ", " + std::to_string(bytes) + " bytes)", err);
  }
  data_ = p;
  size_ = bytes;
}

void ShmRegion::attach(const std::string& name) {
  const int fd = shm_open(name.c_str(), O_RDWR, 0600);
  if (fd < 0) GPUCOLL_SYSCALL_FAIL("shm_open(" + name + ")", errno);
  struct stat st;
  if (fstat(fd, &st) != 0) {
    const int err = errno;
    close(fd);
    GPUCOLL_SYSCALL_FAIL("fstat(" + name + ")", err);
  }
  const size_t bytes = static_cast<size_t>(st.st_size);
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int err = errno;
  close(fd);
  if (p == MAP_FAILED) GPUCOLL_SYSCALL_FAIL("mmap(" + name + ")", err);
  name_ = name;
  data_ = p;
  size_ = bytes;
  linked_ = true;
}

void ShmRegion::unlink() noexcept {
  if (linked_ && !name_.empty()) shm_unlink(name_.c_str());
  linked_ = false;
}

void ShmRegion::unmap() noexcept {
  if (data_ != nullptr) munmap(data_, size_);
  data_ = nullptr;
  size_ = 0;
}

}  // namespace gpucoll::host
