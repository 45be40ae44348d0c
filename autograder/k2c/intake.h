// intake.h — taking a student submission into a clean staging tree.
//
// Only the files the rubric names are taken, and only as regular files no larger than the
// rubric's max_file_bytes: a symlink, a device file or an oversized file is refused, and
// anything else in the submission (a replacement test, a CMakeLists.txt, a rubric) is listed
// as ignored and never copied. The staging tree is a fresh copy of the course's own sources
// (tests, harness, CMake, rubric) with the accepted student files laid over it.
#pragma once

#include <string>
#include <vector>

#include "k2c/rubric.h"

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

// Copies the course at `root` to `dest` without .git, build/, solutions/ and out/ (and without
// any folder that contains `dest`): the staging tree of a submission, and a student handout.
void copy_course(const std::string& root, const std::string& dest);

// Looks for each file at DIR/<rubric path>, then at DIR/<basename> (Gradescope uploads are
// flat). Copies `course_root` (minus .git, build/, solutions/) to `stage_dir` first.
Intake take_submission(const Rubric& rubric, const std::vector<const ModuleSpec*>& modules,
                       const std::string& submission_dir, const std::string& course_root,
                       const std::string& stage_dir);

}  // namespace k2c::grader
