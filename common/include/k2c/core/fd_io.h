// k2c/core/fd_io.h — whole transfers on a file descriptor (a pipe or a socket), carried on across
// short reads and writes and interrupted calls: how the grader's checkers and the test programs
// they talk to move their messages.
#pragma once

#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>

namespace k2c {

// Reads exactly n bytes; false at end of file or on an error.
inline bool read_fully(int fd, void* data, std::size_t n) {
  auto* p = static_cast<char*>(data);
  while (n > 0) {
    const ssize_t got = read(fd, p, n);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) return false;
    p += got;
    n -= static_cast<std::size_t>(got);
  }
  return true;
}

// Writes exactly n bytes; false on an error. A socket whose peer has gone still raises SIGPIPE:
// a test program dies with its checker.
inline bool write_fully(int fd, const void* data, std::size_t n) {
  const auto* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t put = write(fd, p, n);
    if (put < 0 && errno == EINTR) continue;
    if (put <= 0) return false;
    p += put;
    n -= static_cast<std::size_t>(put);
  }
  return true;
}

// Sends exactly n bytes on a socket; false on an error, never SIGPIPE: a checker outlives the
// test program it talks to.
inline bool send_fully(int fd, const void* data, std::size_t n) {
  const auto* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t put = send(fd, p, n, MSG_NOSIGNAL);
    if (put < 0 && errno == EINTR) continue;
    if (put <= 0) return false;
    p += put;
    n -= static_cast<std::size_t>(put);
  }
  return true;
}

}  // namespace k2c
