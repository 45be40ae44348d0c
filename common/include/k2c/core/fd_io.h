// k2c/core/fd_io.h — whole transfers on a file descriptor (a pipe or a socket), carried on across
// short reads and writes and interrupted calls, and a descriptor sent with a message: how the
// grader's checkers and the test programs they talk to move their messages.
#pragma once

#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstring>

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

// The message of send_with_fd and receive_with_fd: n bytes, and room beside them for one
// descriptor. Not copyable: msg points into the object itself.
struct FdMessage {
  iovec iov;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msghdr msg{};
  FdMessage(void* data, std::size_t n) : iov{data, n} {
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof control;
  }
  FdMessage(const FdMessage&) = delete;
  FdMessage& operator=(const FdMessage&) = delete;
};

// Sends exactly n bytes on a Unix socket and, with them, the descriptor `fd` (SCM_RIGHTS: the
// receiver gets a descriptor of its own for the same open file); false on an error, never SIGPIPE.
inline bool send_with_fd(int sock, const void* data, std::size_t n, int fd) {
  FdMessage m(const_cast<void*>(data), n);
  msghdr& msg = m.msg;
  cmsghdr* c = CMSG_FIRSTHDR(&msg);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(int));
  std::memcpy(CMSG_DATA(c), &fd, sizeof fd);
  ssize_t put;
  do put = sendmsg(sock, &msg, MSG_NOSIGNAL);
  while (put < 0 && errno == EINTR);
  if (put <= 0) return false;
  // The descriptor went with the first bytes; the rest, if any, goes as plain bytes.
  return send_fully(sock, static_cast<const char*>(data) + put, n - static_cast<std::size_t>(put));
}

// The other end: reads exactly n bytes and returns the descriptor that came with them (close-on-
// exec), or -1, with nothing left open, if the bytes ended early or came without exactly one.
inline int receive_with_fd(int sock, void* data, std::size_t n) {
  FdMessage m(data, n);
  msghdr& msg = m.msg;
  ssize_t got;
  do got = recvmsg(sock, &msg, MSG_CMSG_CLOEXEC);
  while (got < 0 && errno == EINTR);
  int fd = -1;
  for (cmsghdr* c = got > 0 ? CMSG_FIRSTHDR(&msg) : nullptr; c != nullptr; c = CMSG_NXTHDR(&msg, c))
    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS && c->cmsg_len == CMSG_LEN(sizeof(int)) && fd < 0)
      std::memcpy(&fd, CMSG_DATA(c), sizeof fd);
  const bool whole = got > 0 && read_fully(sock, static_cast<char*>(data) + got, n - static_cast<std::size_t>(got));
  if (!whole || fd < 0 || (msg.msg_flags & MSG_CTRUNC) != 0) {
    if (fd >= 0) close(fd);
    return -1;
  }
  return fd;
}

}  // namespace k2c
