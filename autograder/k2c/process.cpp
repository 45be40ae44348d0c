// process.cpp — see process.h. POSIX only (fork, pipes, process groups).
#include "process.h"

#include <dirent.h>
#include <fcntl.h>
#include <grp.h>
#include <net/if.h>
#include <poll.h>
#include <signal.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace k2c::grader {
namespace {

// Keeps the first `head` and the last `tail` bytes of a stream.
class BoundedCapture {
 public:
  BoundedCapture(std::size_t head, std::size_t tail) : head_cap_(head), tail_cap_(tail) {}
  void add(const char* data, std::size_t n) {
    total_ += n;
    const std::size_t to_head = std::min(n, head_cap_ - head_.size());
    head_.append(data, to_head);
    data += to_head;
    n -= to_head;
    if (n == 0) return;
    tail_.append(data, n);
    if (tail_.size() > 2 * tail_cap_) tail_.erase(0, tail_.size() - tail_cap_);
  }
  std::string text() const {
    std::string tail = tail_.size() > tail_cap_ ? tail_.substr(tail_.size() - tail_cap_) : tail_;
    const std::size_t omitted = total_ - head_.size() - tail.size();
    if (omitted == 0) return head_ + tail;
    return head_ + "\n[... " + std::to_string(omitted) + " bytes omitted ...]\n" + tail;
  }
  std::size_t total() const { return total_; }

 private:
  std::size_t head_cap_, tail_cap_, total_ = 0;
  std::string head_, tail_;
};

// A UTF-8 continuation byte at i: a cut there would split a character.
bool continues(const std::string& s, std::size_t i) {
  return i < s.size() && (static_cast<unsigned char>(s[i]) & 0xC0) == 0x80;
}

// ---- private temporary folders (ProcessOptions::private_tmp)

// What the child binds back into a private folder: an entry of the machine's folder, which the
// child opens (O_PATH) in its new namespace before its tmpfs hides it, then binds from
// /proc/self/fd/N onto a mount point of the same name. (A descriptor opened before unshare()
// names a mount of the machine's namespace, which cannot be bound into the child's.)
struct KeptEntry {
  std::string path;      // the entry, and its mount point in the private folder
  char source[32] = {};  // "/proc/self/fd/N", written by the child without allocating
};

// A folder runs share with the machine (as it resolves here), the tmpfs that replaces it for one
// run, and its entries the run needs. A folder that resolves inside another one (a /var/tmp that
// links into /tmp) is made as a directory in that one's tmpfs instead of mounted.
struct SharedFolder {
  std::string path, options;
  bool nested = false;
  std::vector<KeptEntry> keep;
};

// Absolute paths inside a command-line argument or an environment value: the whole value, or any
// piece of it after ':', '=' or ',' (PATH-like lists, --flag=PATH, json:PATH).
void absolute_paths_in(const std::string& s, std::vector<std::string>& out) {
  for (std::size_t i = 0; i <= s.size();) {
    const std::size_t end = std::min(s.find_first_of(":=,", i), s.size());
    if (end > i && s[i] == '/') out.push_back(s.substr(i, end - i));
    i = end + 1;
  }
}

// Planned in the parent, so that the child makes only system calls on what is built here: which
// folders become private and what each keeps. The paths looked at are those the child will see:
// its working directory, its command line and the environment it gets (the options' variables
// over the inherited ones; PWD and OLDPWD, the grader's own shell history, left out). A path
// naming a folder itself keeps nothing: the run gets the private folder.
std::vector<SharedFolder> plan_private_tmp(const std::vector<std::string>& argv, const ProcessOptions& o) {
  namespace fs = std::filesystem;
  std::vector<std::string> named;
  if (!o.cwd.empty()) named.push_back(fs::absolute(o.cwd).string());
  for (const std::string& a : argv) absolute_paths_in(a, named);
  std::set<std::string> given;
  for (const auto& [k, v] : o.env) given.insert(k), absolute_paths_in(v, named);
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string entry = *e, key = entry.substr(0, entry.find('='));
    if (!given.count(key) && key != "PWD" && key != "OLDPWD") absolute_paths_in(entry.substr(key.size()), named);
  }
  // CUDA's MPS clients reach their daemon through pipes in /tmp/nvidia-mps unless told otherwise:
  // kept only as the daemon leaves it, a folder of root's (not one anybody could plant).
  struct stat mps {};
  if (std::getenv("CUDA_MPS_PIPE_DIRECTORY") == nullptr && lstat("/tmp/nvidia-mps", &mps) == 0 && S_ISDIR(mps.st_mode) &&
      mps.st_uid == 0)
    named.push_back("/tmp/nvidia-mps");
  std::vector<fs::path> resolved;
  for (const std::string& p : named) {
    std::error_code ec;
    const fs::path r = fs::weakly_canonical(p, ec);
    if (!ec) resolved.push_back(r);
  }
  std::vector<SharedFolder> plan;
  for (const char* name : {"/tmp", "/var/tmp", "/dev/shm"}) {
    std::error_code ec;
    const fs::path folder = fs::canonical(name, ec);
    if (ec || !fs::is_directory(folder, ec)) continue;
    bool repeated = false, nested = false;
    for (const SharedFolder& f : plan) {
      const fs::path rel = folder.lexically_relative(f.path);
      repeated = repeated || rel == ".";
      nested = nested || (!rel.empty() && rel != "." && *rel.begin() != "..");
    }
    if (repeated) continue;
    SharedFolder f{folder.string(), "mode=1777,size=1g", nested, {}};
    // Shared memory as large as the machine's /dev/shm (MPI's and NCCL's segments live there).
    struct statvfs vfs {};
    if (name == std::string("/dev/shm") && statvfs(f.path.c_str(), &vfs) == 0 && vfs.f_blocks > 0)
      f.options = "mode=1777,size=" + std::to_string(static_cast<unsigned long long>(vfs.f_blocks) * vfs.f_frsize);
    std::set<std::string> entries;
    for (const fs::path& p : resolved) {
      const fs::path rel = p.lexically_relative(folder);
      if (rel.empty() || rel == "." || *rel.begin() == "..") continue;
      if (fs::exists(folder / *rel.begin(), ec)) entries.insert(rel.begin()->string());
    }
    for (const std::string& entry : entries) f.keep.push_back({f.path + "/" + entry});
    plan.push_back(std::move(f));
  }
  return plan;
}

// In the child, as root, before it changes user: its own mount namespace, each planned folder a
// fresh tmpfs (or, nested, a fresh directory in one) with its entries bound back in from
// descriptors the child opens in its new namespace. Only system calls. Returns the failing step's
// name (errno says why), or nullptr.
const char* make_private_tmp(std::vector<SharedFolder>& plan) {
  if (unshare(CLONE_NEWNS) != 0) return "make a mount namespace (unshare)";
  // Nothing mounted below may reach the machine's namespace (a systemd host shares / by default).
  if (mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0) return "make / private (mount --make-rprivate)";
  for (SharedFolder& f : plan) {
    int fds[64];  // the entries to keep, opened before the tmpfs covers them (-1: left out)
    if (f.keep.size() > std::size(fds)) return "keep so many entries (at most 64 a folder)";
    for (std::size_t i = 0; i < f.keep.size(); ++i) {
      fds[i] = open(f.keep[i].path.c_str(), O_PATH | O_CLOEXEC | O_NOFOLLOW);
      struct stat st {};
      // The plan named each by its canonical path: a link there now was put there since, and is
      // not followed.
      if (fds[i] >= 0 && (fstat(fds[i], &st) != 0 || S_ISLNK(st.st_mode))) close(fds[i]), fds[i] = -1;
    }
    if (f.nested) {
      if (mkdir(f.path.c_str(), 01777) != 0 || chmod(f.path.c_str(), 01777) != 0) return "make a nested folder";
    } else if (mount("tmpfs", f.path.c_str(), "tmpfs", MS_NOSUID | MS_NODEV, f.options.c_str()) != 0) {
      return "mount a tmpfs";
    }
    for (std::size_t i = 0; i < f.keep.size(); ++i) {
      if (fds[i] < 0) continue;
      struct stat st {};
      if (fstat(fds[i], &st) != 0) return "fstat an entry to keep";
      if (S_ISDIR(st.st_mode)) {
        if (mkdir(f.keep[i].path.c_str(), 0755) != 0) return "make a mount point";
      } else {
        const int made = open(f.keep[i].path.c_str(), O_CREAT | O_EXCL | O_WRONLY | O_CLOEXEC, 0644);
        if (made < 0) return "make a mount point";
        close(made);
      }
      char* out = f.keep[i].source;  // "/proc/self/fd/" and the number, by hand
      const char prefix[] = "/proc/self/fd/";
      std::memcpy(out, prefix, sizeof prefix - 1);
      char digits[12];
      int n = 0;
      for (int v = fds[i]; n == 0 || v > 0; v /= 10) digits[n++] = static_cast<char>('0' + v % 10);
      char* at = out + sizeof prefix - 1;
      while (n > 0) *at++ = digits[--n];
      *at = '\0';
      if (mount(out, f.keep[i].path.c_str(), nullptr, MS_BIND | MS_REC, nullptr) != 0) return "bind an entry to keep";
      close(fds[i]);
    }
  }
  return nullptr;
}

// ---- processes of the run's own (ProcessOptions::private_pids)

// Closes every descriptor but `kept`: two calls where the kernel has close_range (5.9), else one
// call a descriptor.
void close_all_but(int kept) {
#ifdef SYS_close_range
  if ((kept == 0 || syscall(SYS_close_range, 0u, static_cast<unsigned>(kept) - 1, 0u) == 0) &&
      syscall(SYS_close_range, static_cast<unsigned>(kept) + 1, ~0u, 0u) == 0)
    return;
#endif
  for (int fd = 0, last = static_cast<int>(std::min<long>(sysconf(_SC_OPEN_MAX), 65536)); fd < last; ++fd)
    if (fd != kept) close(fd);
}

// The child outside the namespace, once the namespace's first process runs: it waits for it and
// ends as the run did, so that the grader's wait reads the run's own status (a namespace's first
// process cannot end itself by a signal; this one can). It holds none of the run's descriptors,
// dumps no core, and is killed with the run's process group on a timeout.
[[noreturn]] void keep_until(pid_t init, int told) {
  close_all_but(told);
  prctl(PR_SET_DUMPABLE, 0);
  const rlimit no_core{0, 0};
  setrlimit(RLIMIT_CORE, &no_core);
  int run_status = 0;
  std::size_t got = 0;
  for (ssize_t n; got < sizeof run_status &&
                  ((n = read(told, reinterpret_cast<char*>(&run_status) + got, sizeof run_status - got)) > 0 ||
                   (n < 0 && errno == EINTR));)
    if (n > 0) got += static_cast<std::size_t>(n);
  int init_status = 0;
  while (waitpid(init, &init_status, 0) < 0 && errno == EINTR) {
  }
  // No word from it: it ended before the run did (a failed start, a kill), and its status stands.
  const int status = got == sizeof run_status ? run_status : init_status;
  if (WIFSIGNALED(status)) {
    signal(WTERMSIG(status), SIG_DFL);
    sigset_t all;
    sigfillset(&all);
    sigprocmask(SIG_UNBLOCK, &all, nullptr);
    kill(getpid(), WTERMSIG(status));
  }
  _exit(WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status));
}

// The namespace's first process, once it has started the run: it holds nothing of the run's,
// reaps what the run orphans, and when the run's first process ends, tells the keeper how and
// ends itself, upon which the kernel kills every process left in the namespace.
[[noreturn]] void init_until(pid_t run, int told) {
  close_all_but(told);
  int status = 0;
  for (;;) {
    int s = 0;
    const pid_t ended = waitpid(-1, &s, 0);
    if (ended == run) {
      status = s;
      break;
    }
    if (ended < 0 && errno != EINTR) {  // cannot happen while the run is its child
      status = 125 << 8;
      break;
    }
  }
  (void)!write(told, &status, sizeof status);
  _exit(0);
}

// In the child, as root, after make_private_tmp (whose mount namespace takes the new mounts): a PID
// namespace whose first process mounts /proc afresh and starts the run, and an IPC namespace (System
// V shared memory, semaphores and message queues, POSIX message queues) that ends with it. unshare()
// moves only the caller's later children into the PID namespace, so the caller stays outside as
// their keeper (keep_until). Returns in the run's process, the namespace's second, or with the
// failing step's name (errno says why), in whichever process failed. Only system calls.
const char* enter_private_pids() {
  if (unshare(CLONE_NEWPID | CLONE_NEWIPC) != 0) return "make PID and IPC namespaces (unshare)";
  int told[2];  // the first process tells the keeper the run's wait status
  if (pipe2(told, O_CLOEXEC) != 0) return "make a pipe";
  const pid_t init = fork();
  if (init < 0) return "start the namespace's first process (fork)";
  if (init > 0) {
    close(told[1]);
    keep_until(init, told[0]);
  }
  close(told[0]);
  prctl(PR_SET_PDEATHSIG, SIGKILL);  // its keeper gone (a timeout's kill), the namespace goes too
  // Only the run's own processes in sight: those of other users (this one, root's) hidden too
  // where the kernel knows hidepid.
  constexpr unsigned long kFlags = MS_NOSUID | MS_NODEV | MS_NOEXEC;
  if (mount("proc", "/proc", "proc", kFlags, "hidepid=2") != 0 && mount("proc", "/proc", "proc", kFlags, nullptr) != 0)
    return "mount the namespace's /proc";
  // The message queues' folder, where there is one, shows the new namespace's (none): through the
  // machine's, a queue of another run could be opened by its path.
  struct stat mq {};
  if (lstat("/dev/mqueue", &mq) == 0 && S_ISDIR(mq.st_mode) && mount("mqueue", "/dev/mqueue", "mqueue", kFlags, nullptr) != 0)
    return "mount the namespace's /dev/mqueue";
  const pid_t run = fork();
  if (run < 0) return "start the run in it (fork)";
  if (run > 0) init_until(run, told[1]);
  close(told[1]);
  return nullptr;
}

// ---- a network of the run's own (ProcessOptions::private_net)

// In the child, as root, before it changes user: a network namespace, whose loopback interface,
// the only one a new namespace holds, starts down and is brought up: the run's ranks bootstrap over
// it (mpirun's own listener does not start without it). Returns the failing step's name (errno
// says why), or nullptr. Only system calls.
const char* enter_private_net() {
  if (unshare(CLONE_NEWNET) != 0) return "make a network namespace (unshare)";
  const int probe = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (probe < 0) return "open a socket to set loopback up";
  ifreq lo{};
  std::memcpy(lo.ifr_name, "lo", 3);
  bool up = ioctl(probe, SIOCGIFFLAGS, &lo) == 0;
  if (up) {
    lo.ifr_flags |= IFF_UP;
    up = ioctl(probe, SIOCSIFFLAGS, &lo) == 0;
  }
  close(probe);
  return up ? nullptr : "bring loopback up";
}

// Tries, in a child of its own, what a run as the unprivileged account would get (the folders,
// with `pids` the processes, with `net` the network), with what the grader's environment names
// kept. Returns "" or why it could not.
std::string trial(bool pids, bool net) {
  if (geteuid() != 0) return "the grader is not root";
  std::vector<SharedFolder> plan = plan_private_tmp({"true"}, {});
  int said[2];  // the child's account of the step that failed
  if (pipe(said) != 0) return std::string("cannot make a pipe: ") + std::strerror(errno);
  const pid_t pid = fork();
  if (pid < 0) {
    close(said[0]), close(said[1]);
    return std::string("cannot fork: ") + std::strerror(errno);
  }
  if (pid == 0) {
    close(said[0]);
    const char* failed = make_private_tmp(plan);
    if (failed == nullptr && net) failed = enter_private_net();
    if (failed == nullptr && pids) {
      failed = enter_private_pids();
      if (failed == nullptr && getpid() != 2) errno = ESRCH, failed = "start the run as the namespace's second process";
    }
    if (failed == nullptr) _exit(0);
    const char* why = std::strerror(errno);
    (void)!write(said[1], failed, std::strlen(failed));
    (void)!write(said[1], ": ", 2);
    (void)!write(said[1], why, std::strlen(why));
    _exit(1);
  }
  close(said[1]);
  std::string account;
  char buf[256];
  for (ssize_t n; (n = read(said[0], buf, sizeof buf)) > 0 || (n < 0 && errno == EINTR);)
    if (n > 0) account.append(buf, static_cast<std::size_t>(n));
  close(said[0]);
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return "";
  return "the trial could not " + (account.empty() ? std::string("finish (it ended by a signal)") : account);
}

}  // namespace

std::string private_tmp_problem() { return trial(false, false); }
std::string private_pids_problem() {
  // CUDA's MPS daemon knows its clients by their process IDs: where it runs (its pipe folder named,
  // or in /tmp as the daemon makes it, a folder of root's), the processes stay shared.
  struct stat mps {};
  if (std::getenv("CUDA_MPS_PIPE_DIRECTORY") != nullptr ||
      (lstat("/tmp/nvidia-mps", &mps) == 0 && S_ISDIR(mps.st_mode) && mps.st_uid == 0))
    return "CUDA's MPS runs here (its pipe folder is named or in /tmp)";
  return trial(true, false);
}
std::string private_net_problem() { return trial(false, true); }

std::string valid_utf8(std::string_view s) {
  static constexpr std::uint32_t kLeast[] = {0, 0, 0x80, 0x800, 0x10000};  // the shortest form's bound
  std::string out;
  out.reserve(s.size());
  for (std::size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    const std::size_t len = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xE ? 3 : (c >> 3) == 0x1E ? 4 : 0;
    bool ok = len > 0 && i + len <= s.size();
    std::uint32_t code = c & (0x7F >> len);
    for (std::size_t k = 1; ok && k < len; ++k) {
      const auto next = static_cast<unsigned char>(s[i + k]);
      ok = (next & 0xC0) == 0x80;
      code = code << 6 | (next & 0x3F);
    }
    ok = ok && (len == 1 || (code >= kLeast[len] && code <= 0x10FFFF && (code < 0xD800 || code > 0xDFFF)));
    if (ok) {
      out.append(s.substr(i, len));
      i += len;
    } else {
      out += "\xEF\xBF\xBD";  // U+FFFD
      ++i;
    }
  }
  return out;
}

std::string utf8_head(const std::string& text, std::size_t max_bytes) {
  if (text.size() <= max_bytes) return text;
  std::size_t cut = max_bytes;
  while (cut > 0 && continues(text, cut)) --cut;
  return text.substr(0, cut);
}

std::string utf8_tail(const std::string& text, std::size_t max_bytes) {
  if (text.size() <= max_bytes) return text;
  std::size_t cut = text.size() - max_bytes;
  while (continues(text, cut)) ++cut;
  return text.substr(cut);
}

namespace {
pid_t child_of(pid_t parent);  // below
}  // namespace

ProcessResult run_process(const std::vector<std::string>& argv, const ProcessOptions& o) {
  ProcessResult r;
  const auto t0 = std::chrono::steady_clock::now();
  int fds[2];
  if (argv.empty() || pipe(fds) != 0) {
    r.output = "cannot start: " + std::string(argv.empty() ? "empty command" : std::strerror(errno));
    return r;
  }
  std::vector<SharedFolder> private_plan = o.private_tmp && o.uid >= 0 ? plan_private_tmp(argv, o) : std::vector<SharedFolder>{};
  const pid_t pid = fork();
  if (pid < 0) {
    r.output = "cannot fork: " + std::string(std::strerror(errno));
    close(fds[0]);
    close(fds[1]);
    return r;
  }
  if (pid == 0) {  // child: own session, output into the pipe, then exec
    // A session of its own, not only a process group: code under test that kept the grader's
    // controlling terminal could open /dev/tty and push keystrokes into the shell that started
    // the grader (TIOCSTI), as that shell's user. A new session has no terminal. The grader's
    // session keyring is left behind too (an anonymous one instead; ignored where keyrings are
    // not built in).
    if (setsid() < 0) _exit(125);
    (void)syscall(SYS_keyctl, 1 /* KEYCTL_JOIN_SESSION_KEYRING */, nullptr);
    dup2(fds[1], STDOUT_FILENO);
    dup2(fds[1], STDERR_FILENO);
    close(fds[0]);
    close(fds[1]);
    const int devnull = open("/dev/null", O_RDONLY);
    if (devnull >= 0) dup2(devnull, STDIN_FILENO);
    // Temporary folders of its own (before the loop below, which would close what they open).
    if (o.private_tmp && o.uid >= 0) {
      if (const char* failed = make_private_tmp(private_plan)) {
        const std::string msg = std::string("cannot make private temporary folders: could not ") + failed + ": " + std::strerror(errno) + "\n";
        (void)!write(STDERR_FILENO, msg.data(), msg.size());
        _exit(125);
      }
      // A network of its own (its keeper's too, which is harmless: the keeper opens no socket).
      if (o.private_net) {
        if (const char* failed = enter_private_net()) {
          const std::string msg = std::string("cannot give the run a network of its own: could not ") + failed + ": " + std::strerror(errno) + "\n";
          (void)!write(STDERR_FILENO, msg.data(), msg.size());
          _exit(125);
        }
      }
      // Processes of its own: from here on this is the run's first process, inside the namespace.
      if (o.private_pids) {
        if (const char* failed = enter_private_pids()) {
          const std::string msg = std::string("cannot give the run processes of its own: could not ") + failed + ": " + std::strerror(errno) + "\n";
          (void)!write(STDERR_FILENO, msg.data(), msg.size());
          _exit(125);
        }
      }
    }
    // Nothing else of the grader's open files reaches the code under test (but the channel).
    int first_closed = 3;
    if (o.channel_fd >= 0) {
      if (o.channel_fd != 3 && dup2(o.channel_fd, 3) < 0) _exit(127);
      first_closed = 4;
    }
    for (int fd = first_closed, last = static_cast<int>(std::min<long>(sysconf(_SC_OPEN_MAX), 65536)); fd < last; ++fd) close(fd);
    if (!o.cwd.empty() && chdir(o.cwd.c_str()) != 0) _exit(127);
    for (const auto& [k, v] : o.env) setenv(k.c_str(), v.c_str(), 1);
    // Code under test cannot take the machine down with it: the kernel's out-of-memory killer takes
    // it before anything else (the grader included), and its account holds at most kMaxProcesses
    // processes and threads (a fork bomb stops there). Set as root: after the switch below the
    // limit cannot be raised, nor the standing lowered where root holds CAP_SYS_RESOURCE (without
    // it the kernel lets a process go back down to the floor it inherited, the grader's).
    if (o.uid >= 0) {
      const int adj = open("/proc/self/oom_score_adj", O_WRONLY | O_CLOEXEC);  // raising it is always allowed
      if (adj >= 0) (void)!write(adj, "1000", 4), close(adj);
      const rlimit processes{kMaxProcesses, kMaxProcesses};
      if (setrlimit(RLIMIT_NPROC, &processes) != 0) _exit(125);
    }
    // Code under test as an unprivileged user: groups first, then the group, then the user (after
    // setuid nothing else could be changed). Any failure ends the child before it runs anything.
    if ((o.gid >= 0 && (setgroups(0, nullptr) != 0 || setgid(static_cast<gid_t>(o.gid)) != 0)) ||
        (o.uid >= 0 && setuid(static_cast<uid_t>(o.uid)) != 0)) {
      const std::string msg = "cannot switch to user " + std::to_string(o.uid) + ": " + std::strerror(errno) + "\n";
      (void)!write(STDERR_FILENO, msg.data(), msg.size());
      _exit(125);
    }
    std::vector<char*> args;
    for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    execvp(args[0], args.data());
    const std::string msg = "cannot execute " + argv[0] + ": " + std::strerror(errno) + "\n";
    (void)!write(STDERR_FILENO, msg.data(), msg.size());
    _exit(127);
  }
  // The child's setsid() makes its process group; wait for it (a few microseconds), so that the
  // group exists before we might signal it. A child that already ended leaves a zombie with the
  // same answer until it is reaped below.
  for (int i = 0; i < 100000 && getpgid(pid) != pid; ++i) usleep(10);
  if (o.on_start) o.on_start(static_cast<int>(pid));
  close(fds[1]);
  fcntl(fds[0], F_SETFL, O_NONBLOCK);
  r.started = true;

  BoundedCapture capture(o.keep_head, o.keep_tail);
  const auto deadline = t0 + std::chrono::duration<double>(o.timeout_s);
  int status = 0;
  bool exited = false, eof = false;
  char buf[65536];
  // Read until the child has exited and the pipe is drained; a grandchild that keeps the pipe
  // open cannot hold us past the deadline, and is killed with the group at the end.
  while (!(exited && eof)) {
    const auto now = std::chrono::steady_clock::now();
    if (now >= deadline) {
      r.timed_out = !exited;
      break;
    }
    const int wait_ms = exited ? 100 : 50;
    pollfd p{fds[0], POLLIN, 0};
    const int ready = eof ? 0 : poll(&p, 1, wait_ms);
    if (ready > 0) {
      const ssize_t n = read(fds[0], buf, sizeof buf);
      if (n > 0)
        capture.add(buf, static_cast<std::size_t>(n));
      else if (n == 0 || (errno != EAGAIN && errno != EINTR))
        eof = true;
    } else if (eof) {
      usleep(20000);
    }
    if (!exited && waitpid(pid, &status, WNOHANG) == pid) exited = true;
    if (exited && !eof && ready == 0) eof = true;  // exited and nothing more within the poll
  }
  // A run with processes of its own that is still going: the child is its keeper, whose child is
  // the namespace's first process (root's). Killed with the group, that one comes to this process
  // where it adopts orphans, and is reaped here once the namespace is down.
  const pid_t first = !exited && o.private_pids && o.private_tmp && o.uid >= 0 ? child_of(pid) : -1;
  kill(-pid, SIGKILL);  // the group: stray grandchildren included
  if (!exited) waitpid(pid, &status, 0);
  for (int i = 0; first > 0 && i < 1000 && waitpid(first, nullptr, WNOHANG) == 0; ++i) usleep(10000);
  close(fds[0]);

  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  r.output = valid_utf8(capture.text());
  r.output_bytes = capture.total();
  if (r.timed_out) return r;
  if (WIFEXITED(status)) r.exit_code = WEXITSTATUS(status);
  if (WIFSIGNALED(status)) r.signal = WTERMSIG(status);
  return r;
}

void adopt_orphans() { prctl(PR_SET_CHILD_SUBREAPER, 1); }

namespace {
// The state and parent of /proc/PID (fields 3 and 4 of its stat, after the command name, which may
// hold spaces and parentheses); parent -1 if it cannot be read.
struct ProcStat {
  char state = '?';
  int parent = -1;
};
ProcStat proc_stat(const std::string& dir) {
  std::ifstream in(dir + "/stat");
  std::string stat;
  std::getline(in, stat);
  const std::size_t end = stat.rfind(')');
  ProcStat s;
  if (end == std::string::npos) return s;
  std::istringstream rest(stat.substr(end + 1));
  rest >> s.state >> s.parent;
  return s;
}

// A child of `parent`, from /proc, or -1.
pid_t child_of(pid_t parent) {
  DIR* proc = opendir("/proc");
  if (proc == nullptr) return -1;
  pid_t found = -1;
  while (const dirent* e = readdir(proc))
    if (e->d_name[0] >= '1' && e->d_name[0] <= '9' && proc_stat(std::string("/proc/") + e->d_name).parent == parent) {
      found = static_cast<pid_t>(std::atoi(e->d_name));
      break;
    }
  closedir(proc);
  return found;
}
}  // namespace

namespace {
// kill_run_leftovers and kill_descendants: every process below this one of user `uid` (-1: of
// every user), and those of `uid` with the mark wherever they are.
int kill_below(int uid, const std::string& marker) {
  const std::string tag = "K2C_RUN=" + marker;
  const pid_t self = getpid();
  std::set<pid_t> killed;  // a killed process may still be dying at the next pass: counted once
  // Passes until one finds nothing (or 10 s, against a process the kernel cannot end at once): a
  // process may fork between the reading of /proc and the kill, and its child is then found by the
  // next pass (it is this process's descendant all the same: as the subreaper, this process adopts
  // whatever loses its parent below it).
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (std::chrono::steady_clock::now() < deadline) {
    struct Entry {
      pid_t parent;
      bool users;   // a process of `uid`
      bool zombie;  // dead, waiting for its parent to reap it (not a leader that left threads running)
      bool marked;
    };
    std::map<pid_t, Entry> procs;
    DIR* proc = opendir("/proc");
    if (proc == nullptr) break;
    while (const dirent* e = readdir(proc)) {
      const char* name = e->d_name;
      if (name[0] < '1' || name[0] > '9') continue;
      const std::string dir = std::string("/proc/") + name;
      struct stat st {};
      if (stat(dir.c_str(), &st) != 0) continue;
      const ProcStat ps = proc_stat(dir);
      // A process whose first thread has exited shows as a zombie while its other threads run:
      // dead only with no task left beside that thread.
      bool zombie = ps.state == 'Z';
      if (zombie) {
        int tasks = 0;
        std::error_code ec;
        for (auto t = std::filesystem::directory_iterator(dir + "/task", ec); !ec && t != std::filesystem::directory_iterator();
             t.increment(ec))
          ++tasks;
        zombie = tasks <= 1;
      }
      Entry entry{static_cast<pid_t>(ps.parent), uid < 0 || static_cast<int>(st.st_uid) == uid, zombie, false};
      if (entry.users && uid >= 0 && !marker.empty()) {
        std::ifstream environ(dir + "/environ", std::ios::binary);
        for (std::string var; !entry.marked && std::getline(environ, var, '\0');) entry.marked = var == tag;
      }
      procs[static_cast<pid_t>(std::atoi(name))] = entry;
    }
    closedir(proc);
    // The user's processes below this one (however deep, whatever their environment), and those
    // with the run's mark wherever they are.
    auto below_self = [&](pid_t pid) {
      for (int depth = 0; depth < 4096 && pid > 1; ++depth) {
        const auto it = procs.find(pid);
        if (it == procs.end()) return false;
        pid = it->second.parent;
        if (pid == self) return true;
      }
      return false;
    };
    // Each one is sent the kill, zombie or not (to a true zombie it does nothing); the passes go on
    // while any of them was still alive.
    bool alive = false;
    std::vector<pid_t> children;
    for (const auto& [pid, e] : procs) {
      // A dead child of this process, whatever its user: the first process of a run's PID namespace
      // (root's) that a time limit's kill left to this process with its keeper.
      if (e.zombie && e.parent == self && !e.users) waitpid(pid, nullptr, WNOHANG);
      if (!e.users || !(e.marked || below_self(pid))) continue;
      kill(pid, SIGKILL);
      if (!e.zombie) alive = true, killed.insert(pid);
      if (e.parent == self) children.push_back(pid);
    }
    // A child of this process (adopted, or started by it) is reaped here, or it stays a zombie;
    // a zombie's own dead children then become this process's, for the next pass.
    for (const pid_t pid : children)
      for (int i = 0; i < 50 && std::chrono::steady_clock::now() < deadline && waitpid(pid, nullptr, WNOHANG) == 0; ++i)
        usleep(2000);
    if (!alive && children.empty()) break;
    if (children.empty()) usleep(2000);  // killed, not yet dead: give them a moment
  }
  return static_cast<int>(killed.size());
}
}  // namespace

int kill_run_leftovers(int uid, const std::string& marker) {
  if (uid <= 0) return 0;  // never root's processes
  return kill_below(uid, marker);
}

int kill_descendants() { return kill_below(-1, ""); }

std::string describe_exit(const ProcessResult& r, double timeout_s) {
  if (!r.started) return r.output;
  if (r.timed_out) return "timed out after " + std::to_string(static_cast<int>(timeout_s)) + " s";
  if (r.signal > 0)
    return "killed by signal " + std::to_string(r.signal) + " (" + strsignal(r.signal) + ")";
  return "exit code " + std::to_string(r.exit_code);
}

namespace {

// The bytes of what the compiler wrote at `from`, in a folder of user `uid`'s: a plain file of that
// user's with one name (never through a link, never a FIFO or a hard link to another file), and,
// for the object, an ELF relocatable object (not, say, a linker script naming other files).
std::string compiler_output(const std::string& from, int uid, bool object) {
  const int in = open(from.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
  struct stat st {};
  const bool plain = in >= 0 && fstat(in, &st) == 0 && S_ISREG(st.st_mode) && static_cast<int>(st.st_uid) == uid &&
                     st.st_nlink == 1;
  std::string bytes;
  char buf[1 << 16];
  ssize_t n = 0;
  while (plain && (n = read(in, buf, sizeof buf)) > 0) bytes.append(buf, static_cast<std::size_t>(n));
  if (in >= 0) close(in);
  if (!plain || n < 0) throw std::runtime_error("the compiler wrote no plain file " + from);
  // e_ident "\x7fELF", e_type (bytes 16-17, little-endian on the machines the course runs on) ET_REL.
  if (object && (bytes.size() < 18 || bytes.compare(0, 4, "\x7f" "ELF") != 0 || bytes[16] != 1 || bytes[17] != 0))
    throw std::runtime_error(from + " is not an object file");
  return bytes;
}

// Writes `bytes` to `to` in the build tree: into a new file beside it, then renamed over it, so
// that a failed write leaves no object that looks built.
void write_output(const std::string& to, const std::string& bytes) {
  const std::string temp = to + ".k2c-part";
  const int out = open(temp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_CLOEXEC, 0644);
  bool ok = out >= 0;
  for (std::size_t done = 0; ok && done < bytes.size();) {
    const ssize_t w = write(out, bytes.data() + done, bytes.size() - done);
    ok = w > 0;
    done += w > 0 ? static_cast<std::size_t>(w) : 0;
  }
  if (out >= 0 && close(out) != 0) ok = false;
  if (!ok || rename(temp.c_str(), to.c_str()) != 0) {
    unlink(temp.c_str());
    throw std::runtime_error("cannot write " + to + ": " + std::strerror(errno));
  }
}

}  // namespace

namespace {
// Whether `folder` is one compile_as may make scratch folders in and the grader may clear: a real
// folder (not a link) of this process's user that no one else may write.
bool scratch_parent(const std::filesystem::path& folder) {
  struct stat st {};
  return lstat(folder.c_str(), &st) == 0 && S_ISDIR(st.st_mode) && st.st_uid == geteuid() &&
         (st.st_mode & (S_IWGRP | S_IWOTH)) == 0;
}
}  // namespace

std::vector<std::pair<std::string, std::string>> compile_scratch_env(const std::filesystem::path& folder) {
  std::error_code ec;
  const std::filesystem::file_status st = std::filesystem::symlink_status(folder, ec);
  if (std::filesystem::exists(st) && !std::filesystem::is_directory(st)) std::filesystem::remove(folder, ec);
  std::filesystem::create_directories(folder, ec);
  // Searchable by the user a scratch folder is handed to, so that it reaches its own; listable and
  // writable by the grader only.
  std::filesystem::permissions(folder, std::filesystem::perms::owner_all | std::filesystem::perms::group_exec |
                                           std::filesystem::perms::others_exec,
                               std::filesystem::perm_options::replace, ec);
  if (ec || !scratch_parent(folder)) return {{kCompileScratch, ""}};  // compile_as then takes /tmp
  return {{kCompileScratch, std::filesystem::absolute(folder).string()}};
}

int clear_compile_scratch(const std::filesystem::path& folder) {
  if (!scratch_parent(folder)) return 0;  // a link, or a folder another user could have prepared
  int removed = 0;
  std::error_code ec;
  for (auto it = std::filesystem::directory_iterator(folder, ec); !ec && it != std::filesystem::directory_iterator();
       it.increment(ec)) {
    std::error_code gone;
    std::filesystem::remove_all(it->path(), gone);  // links are removed, never followed
    if (!gone) ++removed;
  }
  return removed;
}

int compile_as(int uid, int gid, const std::vector<std::string>& command) {
  if (uid <= 0 || gid < 0) throw std::invalid_argument("compile-as: expected a user other than root");
  // Ends with the build that started it (the grader kills a build that runs past its limit, and
  // the build runs each command in a process group of its own, out of that kill's reach); the
  // compiler it leaves is then below the grader, which kills it as a run's leftover.
  const pid_t build = getppid();
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (getppid() != build) return 1;  // it ended before the request took hold
  // The scratch folder: made by the grader (mkdtemp: a fresh name, 0700), then handed to the user,
  // in the folder the grading names (compile_scratch_env: one it empties after each build, where
  // a compile-as killed with its build leaves its own behind) or else in /tmp.
  const char* named = std::getenv(kCompileScratch);
  const bool usable = named != nullptr && named[0] == '/' && scratch_parent(named);
  std::string scratch = std::string(usable ? named : "/tmp") + "/k2c-compile-XXXXXX";
  if (mkdtemp(scratch.data()) == nullptr) throw std::runtime_error(std::string("compile-as: mkdtemp: ") + std::strerror(errno));
  struct Remove {
    std::string path;
    ~Remove() {
      std::error_code ec;
      std::filesystem::remove_all(path, ec);
    }
  } remove{scratch};
  if (chown(scratch.c_str(), static_cast<uid_t>(uid), static_cast<gid_t>(gid)) != 0)
    throw std::runtime_error("compile-as: cannot hand " + scratch + " to user " + std::to_string(uid) + ": " +
                             std::strerror(errno));
  // The outputs the build expects (-o, -MF), each redirected into the scratch folder.
  std::vector<std::string> cmd = command;
  struct Output {
    std::string there, here;  // written there, expected here
    bool object;
  };
  std::vector<Output> outputs;
  for (std::size_t i = 0; i + 1 < cmd.size(); ++i)
    if (cmd[i] == "-o" || cmd[i] == "-MF") {
      const std::string there = scratch + "/" + std::to_string(outputs.size()) + "-" +
                                std::filesystem::path(cmd[i + 1]).filename().string();
      outputs.push_back({there, cmd[i + 1], cmd[i] == "-o"});
      cmd[++i] = there;
    }
  if (std::none_of(outputs.begin(), outputs.end(), [](const Output& o) { return o.object; }))
    throw std::invalid_argument("compile-as: the command names no object (-o)");
  // The user's own scratch for everything a compiler writes on the side; a compiler cache (a
  // ccache in front of the compiler) is bypassed, its folder being the grader's.
  const ProcessResult r = run_process(
      cmd, {.env = {{"TMPDIR", scratch}, {"HOME", scratch}, {"CCACHE_DISABLE", "1"}}, .timeout_s = 1800, .uid = uid, .gid = gid});
  std::fwrite(r.output.data(), 1, r.output.size(), stderr);
  if (r.timed_out) std::fprintf(stderr, "k2c compile-as: the compiler ran past 1800 s and was stopped\n");
  if (!r.started || r.exit_code != 0) return r.exit_code > 0 ? r.exit_code : 1;
  // Every output read before any is written: the build sees all of them or none.
  std::vector<std::string> bytes;
  for (const Output& o : outputs) bytes.push_back(compiler_output(o.there, uid, o.object));
  for (std::size_t k = 0; k < outputs.size(); ++k) write_output(outputs[k].here, bytes[k]);
  return 0;
}

}  // namespace k2c::grader
