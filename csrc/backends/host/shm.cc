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
  close_fd();
  unmap();
}

void ShmRegion::create(size_t bytes) {
  const int fd = memfd_create("gpucoll-host", MFD_CLOEXEC);
  if (fd < 0) GPUCOLL_SYSCALL_FAIL("memfd_create(gpucoll-host)", errno);
  what_ = "memfd of pid " + std::to_string(getpid());
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    const int err = errno;
    ::close(fd);
    GPUCOLL_SYSCALL_FAIL("ftruncate(" + what_ + ", " + std::to_string(bytes) + ")", err);
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    const int err = errno;
    ::close(fd);
    GPUCOLL_SYSCALL_FAIL("mmap(" + what_ + ", " + std::to_string(bytes) + " bytes)", err);
  }
  std::random_device rd;
  for (uint64_t& t : handle_.token) t = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  handle_.pid = getpid();
  handle_.fd = fd;
  fd_ = fd;
  data_ = p;
  size_ = bytes;
}

void ShmRegion::attach(const ShmHandle& h) {
  // The values came over the network: bound them before they form a path (a pid_t and an fd are both ints).
  GPUCOLL_CHECK_ARG(h.pid > 0 && h.pid <= 0x7fffffff && h.fd >= 0 && h.fd <= 0x7fffffff,
                    "the host backend's region handle is malformed: pid=", h.pid, " fd=", h.fd);
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%d/fd/%d", static_cast<int>(h.pid), static_cast<int>(h.fd));
  what_ = path;
  const int fd = ::open(path, O_RDWR | O_CLOEXEC);
  if (fd < 0) GPUCOLL_SYSCALL_FAIL(std::string("open(") + path + ")", errno);
  struct stat st;
  if (fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    GPUCOLL_SYSCALL_FAIL(std::string("fstat(") + path + ")", err);
  }
  // Only a non-empty regular file of this user. (root can open anyone's descriptors through /proc: the owner
  // check keeps a rank running as root out of another user's file.) The caller checks the header and the token.
  if (!S_ISREG(st.st_mode) || st.st_uid != geteuid() || st.st_size <= 0) {
    ::close(fd);
    GPUCOLL_INVALID_ARG("the host backend's region at ", path, " is not this job's: expected a regular file of uid ",
                        geteuid(), ", found ", (S_ISREG(st.st_mode) ? "a regular" : "a non-regular"), " file of uid ",
                        st.st_uid, " and ", st.st_size, " bytes");
  }
  const size_t bytes = static_cast<size_t>(st.st_size);
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int err = errno;
  ::close(fd);
  if (p == MAP_FAILED) GPUCOLL_SYSCALL_FAIL(std::string("mmap(") + path + ")", err);
  data_ = p;
  size_ = bytes;
  // The creator's pid and token name the region alike on every rank (the flight recorder's dumps use them); the
  // descriptor is the creator's, not this process's.
  handle_ = h;
  handle_.fd = -1;
}

void ShmRegion::close_fd() noexcept {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
  handle_.fd = -1;
}

void ShmRegion::unmap() noexcept {
  if (data_ != nullptr) munmap(data_, size_);
  data_ = nullptr;
  size_ = 0;
}

}  // namespace gpucoll::host
