// intake.h — taking a student submission into a clean staging tree, and checking what it built.
//
// Only the files the rubric names are taken, and only as regular files no larger than the
// rubric's max_file_bytes, reached from the submission's root without passing through a
// symbolic link: a link (of the file or of any folder on its way), a device file or an
// oversized file is refused, and anything else in the submission (a replacement test, a
// CMakeLists.txt, a rubric) is listed as ignored and never copied. The staging tree holds the
// course's own sources (tests, harness, CMake, rubric) with the accepted student files laid over
// them, and nothing else, kept outside the course tree so that no relative path leads back into
// it. Grading the next submission into the same build folder rewrites only the files that
// differ, so that its build recompiles the student's files, not the course.
//
// After a module is built, its student code is checked for what it could have brought in:
// headers from outside the submission (read from the build's own dependency records), and
// libraries loaded at run time (read from the built library's ELF dynamic section). And while
// grading runs, the course tree is fingerprinted so that code under test that rewrites it is
// noticed before a later module or submission could be graded against the rewrite.
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "k2c/core/rubric.h"

namespace k2c::grader {

struct IntakeFile {
  std::string path;     // the rubric's path, relative to the repository root
  std::string source;   // where it was found in the submission ("" when absent: stub graded)
  std::string problem;  // why it was refused; empty when accepted or absent
};

struct Intake {
  std::vector<IntakeFile> files;     // one per rubric file of the selected modules
  std::vector<std::string> ignored;  // submission entries not named by the rubric
  std::string staged_root;

  // The problem with any of this module's files ("" when all were accepted).
  std::string problem_for(const ModuleSpec& m) const;
};

// Copies the course at `root` to `dest` without .git, build/, solutions/, out/ and lab/ (and
// without any folder that contains `dest`): a student handout, and the files a submission's stage
// holds. No links are copied: a linked file is copied as its bytes, a linked folder left out.
void copy_course(const std::string& root, const std::string& dest);

// Makes the folder `dest` hold exactly `files` (path relative to `dest` -> the file to copy
// there): anything else in it is removed, links included, and only a file whose bytes differ
// from its source's is written. A build tree configured on `dest` then rebuilds only what changed
// since the last time it was filled: the next submission's own files, not the whole course.
void sync_tree(const std::string& dest, const std::map<std::string, std::string>& files);

// Looks for each file at DIR/<rubric path>, then at DIR/<basename> (Gradescope uploads are
// flat). `stage_dir` is made to hold the course at `course_root` as copy_course copies it, with
// the accepted files in place of the stubs (sync_tree).
Intake take_submission(const Rubric& rubric, const std::vector<const ModuleSpec*>& modules,
                       const std::string& submission_dir, const std::string& course_root,
                       const std::string& stage_dir);

// Where a submission is staged: <build_dir>/staged when that lies outside the course tree,
// else a folder of the system's temporary directory private to this user (0700), named after
// the build folder so that the build tree's cache keeps pointing at the same sources.
std::string staging_dir(const std::string& course_root, const std::string& build_dir);

// True when `path` is `dir` or lies below it (both resolved through symbolic links).
bool is_within(const std::string& path, const std::string& dir);

// ------------------------------------------------------------------- headers a build read ---

// The headers each object file of one CMake target was compiled from, as the build recorded
// them: Ninja's deps log (`ninja -t deps`) or the `.o.d` files of the Makefile generator.
struct TargetDeps {
  bool target_found = false;  // a CMakeFiles/<target>.dir exists in the build tree
  std::map<std::string, std::vector<std::string>> objects;  // object -> absolute, normal paths
  std::string error;          // why the records could not be read ("" when they were)
};
TargetDeps target_dependencies(const std::string& build_dir, const std::string& target);

// Parsers of the two formats, for the self-tests. Relative paths are taken from `base`.
std::map<std::string, std::vector<std::string>> parse_ninja_deps(const std::string& text, const std::string& base);
std::vector<std::string> parse_make_depfile(const std::string& text, const std::string& base);

// The compilers' own include folders recorded at configure time
// (CMAKE_<LANG>_IMPLICIT_INCLUDE_DIRECTORIES, the CUDA toolkit's include folders), plus
// /usr/include and /usr/lib/gcc.
std::vector<std::string> system_include_dirs(const std::string& build_dir);

// The first header of `deps` that lies neither in `public_dirs` nor in `system_dirs` outside
// `denied_dirs` (the course, the staging tree, the build tree: a system folder never vouches
// for them), as "<object's source> includes <path>"; "" when all are fine.
std::string include_outside(const TargetDeps& deps, const std::vector<std::string>& public_dirs,
                            const std::vector<std::string>& system_dirs,
                            const std::vector<std::string>& denied_dirs);

// ------------------------------------------------------- libraries loaded at run time ---

// What a shared library asks of the dynamic loader, read from its ELF sections.
struct LibraryFindings {
  std::vector<std::string> needed;          // DT_NEEDED entries
  std::vector<std::string> undefined;       // undefined dynamic symbols
  std::vector<std::string> weak_undefined;  // those of them bound weak (also in `undefined`)
  std::vector<std::string> vendor_strings;  // vendor library names found among its bytes
  std::string error;                        // not a readable 64-bit ELF file
};
LibraryFindings inspect_library(const std::string& path);

// Why the library may be borrowing its speed ("" when nothing is suspicious): it calls the
// loader (dlopen, dlsym, ...), links a library other than the C/C++ runtimes and the CUDA
// runtime, or names a vendor library (libcublas, libcudnn, cutlass, ...).
// `linked`: further libraries the implementation may link, by file name (the implementations of
// the earlier modules it uses, `libk2c_impl_12_data_parallel.so`).
std::string runtime_loading_problem(const LibraryFindings& f, const std::vector<std::string>& linked = {});

// Why the library may not be graded at all ("" when nothing is wrong): it refers weakly to a
// symbol other than those compilers and the C and C++ runtimes leave weak (__gmon_start__, the
// transactional-memory hooks, the C++ ABI's __cxa_*, pthread_*, the sanitizers'). A weak undefined symbol passes the link check (--no-undefined
// lets it through unresolved) and binds at run time to whatever the test program has loaded:
// MPI_Allreduce or ncclAllReduce in a module that must write its own, say.
std::string weak_reference_problem(const LibraryFindings& f);

// The loader entry points the library calls (dlopen, dlsym, ...), "" when none: with them it can
// reach whatever the test program has loaded or can load (MPI, NCCL, cuBLAS), and so borrow not
// only a module's speed but its results: such a library is not graded at all.
std::string loader_calls(const LibraryFindings& f);

// ------------------------------------------------------------------- course fingerprint ---

// A content fingerprint of what a grading reads from a course tree: autograder/, cmake/, common/,
// solutions/, the top-level build files, .git's config and hooks (git itself rewrites the rest of
// .git; those two run code), and the top-level entries that hold any path in `also` (a rubric
// given with --rubric). Student files, lectures and generated data are not watched: a student
// edits assignments/ while grading runs in place. Build trees (the top-level build/, any folder
// that holds a CMakeCache.txt when the watch starts, and the folders in `skip`) are left out.
class TreeWatch {
 public:
  TreeWatch() = default;
  TreeWatch(const std::string& root, const std::vector<std::string>& skip, const std::vector<std::string>& also = {});
  // "autograder/rubric.json (changed)", "x (added)", "y (removed)"; empty when unchanged.
  std::vector<std::string> changes() const;
  const std::string& root() const { return root_; }

 private:
  std::map<std::string, std::uint64_t> digest() const;
  std::string root_;
  std::vector<std::string> skip_;  // relative to root_
  std::set<std::string> watched_;  // top-level names under root_
  std::uint64_t key_ = 0;          // the hash's secret starting point, drawn per watch
  std::map<std::string, std::uint64_t> before_;
};

}  // namespace k2c::grader
