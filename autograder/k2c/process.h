// process.h — running a child program with a time limit and bounded output capture.
//
// The grader never trusts a test program: it may crash, hang, spawn children, or print
// gigabytes. run_process puts the child in its own process group (so a timeout kills the whole
// group), merges stdout and stderr into one pipe, and keeps only the first and last bytes of
// what was printed, so memory stays bounded whatever the child does.
#pragma once

#include <sys/resource.h>

#include <cstddef>
#include <functional>
#include <filesystem>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace k2c::grader {

struct ProcessResult {
  bool started = false;     // false: exec failed (output says why)
  bool timed_out = false;
  int exit_code = -1;       // valid when the child exited normally
  int signal = 0;           // > 0 when the child was killed by a signal
  std::string output;       // head + "[... N bytes omitted ...]" + tail, as UTF-8 text (valid_utf8)
  std::size_t output_bytes = 0;  // total printed
  double seconds = 0;
};

// The processes and threads the runner account may hold while code under test runs as it
// (RLIMIT_NPROC, soft and hard): far above what the course's largest runs start (a few hundred
// threads for eight MPI ranks with CUDA and NCCL, several graders at once), far below a machine's
// process table.
inline constexpr rlim_t kMaxProcesses = 4096;

struct ProcessOptions {
  std::vector<std::pair<std::string, std::string>> env;  // added to the current environment
  std::string cwd;                                        // empty: inherit
  double timeout_s = 600;
  int uid = -1, gid = -1;  // >= 0: the child drops to this user and group before exec (the grader as root)
  std::function<void(int pid)> on_start;  // called once the child runs, with its pid (= its group)
  int channel_fd = -1;     // >= 0: the child gets it as its fd 3 (the witness's socket), beside 0-2
  // With uid >= 0: /tmp, /var/tmp and /dev/shm of the child's own, fresh size-limited tmpfs in a
  // mount namespace of its own that vanish with its last process, so that nothing a run writes there
  // outlives it or meets what earlier runs left. What the run needs from them is bound back in: the
  // entry holding its cwd and each entry named by an absolute path in its command line or in the
  // environment it gets (the run folder, a build or checkout under /tmp). A path naming a folder
  // itself keeps nothing. Ask private_tmp_problem() first: where it cannot be done the child fails
  // to start.
  bool private_tmp = false;
  // With private_tmp: the run's processes in a PID namespace of their own, behind a /proc of its
  // own, so that it can see, signal, trace or enter (/proc/<pid>/root) no process outside the run
  // (a run of the same account at the same time included), and nothing it started outlives it:
  // the namespace's first process, the grader's, starts the run and ends when the run's first
  // process does, and the kernel then kills whatever is left in the namespace, however it left the
  // process group. Its System V and POSIX IPC objects are its own too (an IPC namespace), gone with
  // it. The exit code or signal is the run's own. Ask private_pids_problem() first.
  bool private_pids = false;
  // With private_tmp: a network namespace of the run's own, holding loopback alone (up), so that its
  // ports, abstract Unix sockets and connections meet no other run's (a listener planted where a
  // neighbour's NCCL or Open MPI bootstrap will look, a port held to make it fail) and no network
  // interface of the machine's. Its ranks, all below the run, still meet over loopback, and sockets
  // with a path in the file system are reached as before. Ask private_net_problem() first.
  bool private_net = false;
  std::size_t keep_head = 16 * 1024;
  std::size_t keep_tail = 48 * 1024;
};

ProcessResult run_process(const std::vector<std::string>& argv, const ProcessOptions& options);

// Why this process cannot give its children private temporary folders (ProcessOptions::private_tmp:
// not root, or a container without the right to make mount namespaces), or "" where it can. It
// tries, once, in a child of its own.
std::string private_tmp_problem();
// Why this process cannot give its children processes of their own (ProcessOptions::private_pids),
// or "" where it can; tried once, as private_tmp_problem does, with the temporary folders. Where
// it finds signs of CUDA's MPS (CUDA_MPS_PIPE_DIRECTORY set, a /tmp/nvidia-mps folder of root's) it
// never can: the daemon knows its clients by their process IDs.
std::string private_pids_problem();
// Why this process cannot give its children a network of their own (ProcessOptions::private_net),
// or "" where it can; tried once, with the temporary folders (in a container it needs
// CAP_NET_ADMIN besides CAP_SYS_ADMIN, to bring loopback up).
std::string private_net_problem();

// Makes this process the adopter of its descendants' orphans (PR_SET_CHILD_SUBREAPER): a process
// that a run leaves behind in a session of its own becomes this process's child instead of init's,
// whatever it does to its environment. The grader calls it once, before its first run.
void adopt_orphans();

// Kills what a run left behind, detached from its process group, to meddle with later runs: every
// process of user `uid` below this one in the process tree, however deep and whatever it did to
// its environment (adopt_orphans keeps whatever loses its parent below this process there), and
// every process of that user whose environment holds K2C_RUN=`marker` (the grader sets a fresh
// marker for each run; descendants inherit it; "": none), reaping this process's children (and
// any dead child of another user, such as the first process of a run's PID namespace that a
// checker's kill left to this process; one still dying is reaped at a later call). It
// passes over /proc until a pass finds nothing. Processes of other runs as the same user (a
// second grader on the machine) are left alone. Reading other users' environments needs root.
// Call it only when no run of this process is under way. Returns the number of processes killed.
int kill_run_leftovers(int uid, const std::string& marker);
// Kills every process below this one, whatever its user, the same way: what a build left running
// (under Ninja a compile-as runs below a shell of its own and outlives the build that a time limit
// stopped). Call it only when nothing of this process should be running.
int kill_descendants();

// The compiler launcher of a submission's files: `k2c compile-as UID GID -- COMPILER ARGS...`,
// which CMake runs in place of the compiler for the implementation libraries when the grader
// configures with K2C_COMPILE_AS. The compile runs as that user, so whatever the files #include or
// embed (`.incbin`) is read with that user's rights, not the grader's: a file only root may read
// stays unread, and no compiler message quotes it. Its object (-o) and dependency file (-MF) are
// written into a fresh folder of that user's, then copied by the grader where the build expects
// them, into a tree the user cannot write. Returns the compiler's exit status (1 for a compiler
// that did not exit); what it printed goes to stderr.
int compile_as(int uid, int gid, const std::vector<std::string>& command);

// Where compile_as makes its scratch folders during a grading: the variable (K2C_COMPILE_SCRATCH)
// that names `folder` for the builds' environment, the folder made the grader's own and
// searchable by others (0711), or the variable set empty (compile_as then uses /tmp, as it does
// for any folder that is a link, another user's, or writable by others). A compile-as killed
// mid-way leaves its scratch folder there; clear_compile_scratch removes every entry of `folder`
// (nothing where the folder is not one compile_as would use), without following links, and
// returns how many it removed. Call it when no compile of this grading runs (after
// kill_descendants).
inline constexpr const char* kCompileScratch = "K2C_COMPILE_SCRATCH";
std::vector<std::pair<std::string, std::string>> compile_scratch_env(const std::filesystem::path& folder);
int clear_compile_scratch(const std::filesystem::path& folder);

// `bytes` as well-formed UTF-8: a byte that does not start a well-formed character (an overlong
// form, a surrogate, a character cut by the capture's head and tail) becomes U+FFFD. Whatever a
// program prints ends in the JSON reports, whose writer refuses anything else.
std::string valid_utf8(std::string_view bytes);
// The first (last) at most `max_bytes` bytes of UTF-8 text, cut between characters.
std::string utf8_head(const std::string& text, std::size_t max_bytes);
std::string utf8_tail(const std::string& text, std::size_t max_bytes);

// "exit code 3", "killed by signal 11 (Segmentation fault)", "timed out after 30 s", ...
std::string describe_exit(const ProcessResult& r, double timeout_s);

}  // namespace k2c::grader
