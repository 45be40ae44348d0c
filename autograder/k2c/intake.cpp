// intake.cpp — see intake.h.
#include "intake.h"

#include <filesystem>
#include <set>
#include <stdexcept>

namespace fs = std::filesystem;

namespace k2c::grader {

std::string Intake::problem_for(const ModuleSpec& m) const {
  for (const std::string& f : m.files)
    for (const IntakeFile& i : files)
      if (i.path == f && !i.problem.empty()) return f + ": " + i.problem;
  return "";
}

void copy_course(const std::string& root, const std::string& dest) {
  static const std::set<std::string> kSkip = {".git", "build", "solutions", "out"};
  const fs::path to = fs::weakly_canonical(fs::absolute(dest));
  fs::create_directories(to);
  for (const auto& entry : fs::directory_iterator(root)) {
    const std::string name = entry.path().filename().string();
    if (kSkip.count(name)) continue;
    // Never copy a folder that holds the destination: it would copy into itself.
    const fs::path from = fs::weakly_canonical(entry.path());
    const auto rel = to.lexically_relative(from);
    if (!rel.empty() && *rel.begin() != "..") continue;
    fs::copy(entry.path(), to / name, fs::copy_options::recursive | fs::copy_options::copy_symlinks);
  }
}

Intake take_submission(const Rubric& rubric, const std::vector<const ModuleSpec*>& modules,
                       const std::string& submission_dir, const std::string& course_root,
                       const std::string& stage_dir) {
  const fs::path sub(submission_dir);
  if (!fs::is_directory(sub))
    throw std::runtime_error("submission: " + submission_dir + " is not a directory");

  Intake in;
  const fs::path stage = fs::absolute(stage_dir);
  fs::remove_all(stage);
  copy_course(course_root, stage.string());
  in.staged_root = stage.string();

  std::set<std::string> wanted_rel, wanted_base;
  for (const ModuleSpec* m : modules)
    for (const std::string& f : m->files) {
      wanted_rel.insert(f);
      wanted_base.insert(fs::path(f).filename().string());
    }

  for (const ModuleSpec* m : modules) {
    for (const std::string& f : m->files) {
      IntakeFile item{f, "", ""};
      fs::path found;
      for (const fs::path& p : {sub / f, sub / fs::path(f).filename()})
        if (fs::exists(fs::symlink_status(p))) {
          found = p;
          break;
        }
      if (found.empty()) {  // the staged tree keeps the stub: graded as "not implemented yet"
        in.files.push_back(item);
        continue;
      }
      item.source = found.string();
      const fs::file_status st = fs::symlink_status(found);
      if (fs::is_symlink(st))
        item.problem = "refused: it is a symbolic link";
      else if (!fs::is_regular_file(st))
        item.problem = "refused: not a regular file";
      else if (fs::file_size(found) > rubric.max_file_bytes)
        item.problem = "refused: " + std::to_string(fs::file_size(found)) + " bytes, more than " +
                       std::to_string(rubric.max_file_bytes);
      else
        fs::copy_file(found, stage / f, fs::copy_options::overwrite_existing);
      in.files.push_back(item);
    }
  }

  // Everything else in the submission is reported, never copied.
  for (auto it = fs::recursive_directory_iterator(sub); it != fs::recursive_directory_iterator();
       ++it) {
    if (fs::is_directory(it->symlink_status())) continue;
    const std::string rel = fs::relative(it->path(), sub).string();
    const bool named = wanted_rel.count(rel) ||
                       (rel.find('/') == std::string::npos && wanted_base.count(rel));
    if (!named) in.ignored.push_back(rel);
  }
  return in;
}

}  // namespace k2c::grader
