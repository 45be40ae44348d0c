// intake.cpp — see intake.h.
#include "intake.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <set>
#include <sstream>
#include <stdexcept>

#include "process.h"

namespace fs = std::filesystem;

namespace k2c::grader {
namespace {

// FNV-1a, 64 bits: fast, and enough to notice a rewrite. TreeWatch starts it from a secret
// drawn per grading run, which the code under test never sees, so that it cannot compute a
// same-hash rewrite offline; it is still no cryptographic hash (docs/SECURITY.md).
constexpr std::uint64_t kFnvOffset = 0xcbf29ce484222325ull, kFnvPrime = 0x100000001b3ull;
std::uint64_t fnv1a(const char* data, std::size_t n, std::uint64_t h = kFnvOffset) {
  for (std::size_t i = 0; i < n; ++i) h = (h ^ static_cast<unsigned char>(data[i])) * kFnvPrime;
  return h;
}

std::string read_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

// A path made absolute and resolved through any symbolic links that exist, so that two names
// of one file compare equal and `..` cannot hide where a path leads (`link/..` is resolved as
// the system does: from the link's target, not by striking out the link's name).
fs::path resolved(const fs::path& p) {
  std::error_code ec;
  fs::path r = fs::weakly_canonical(fs::absolute(p), ec);
  return ec ? fs::absolute(p).lexically_normal() : r;
}

bool within(const fs::path& path, const fs::path& dir) {
  const fs::path rel = path.lexically_relative(dir);
  return !rel.empty() && *rel.begin() != "..";
}

// Walks `rel` down from `base` one name at a time without following links. `exists` says
// whether the whole path exists; `link` names the first component that is a symbolic link.
struct Walk {
  bool exists = false;
  std::string link, target;
};
Walk walk_without_links(const fs::path& base, const fs::path& rel) {
  Walk w;
  fs::path at = base, shown;
  for (const fs::path& part : rel) {
    at /= part;
    shown /= part;
    std::error_code ec;
    const fs::file_status st = fs::symlink_status(at, ec);
    if (ec || !fs::exists(st)) return w;
    if (fs::is_symlink(st)) {
      w.exists = true;
      w.link = shown.string();
      w.target = fs::read_symlink(at, ec).string();
      return w;
    }
  }
  w.exists = true;
  return w;
}

// "KEY:TYPE=value" of a CMakeCache.txt, "" when absent.
std::string cache_value(const std::string& cache, const std::string& key) {
  std::istringstream in(cache);
  for (std::string line; std::getline(in, line);)
    if (line.rfind(key + ":", 0) == 0) {
      const auto eq = line.find('=');
      return eq == std::string::npos ? "" : line.substr(eq + 1);
    }
  return "";
}

// The folders named CMakeFiles/<target>.dir anywhere in the build tree (CMake puts a target's
// objects under the binary folder of the CMakeLists.txt that declared it).
std::vector<fs::path> target_dirs(const fs::path& build, const std::string& target) {
  std::vector<fs::path> out;
  std::error_code ec;
  for (auto it = fs::recursive_directory_iterator(build, fs::directory_options::skip_permission_denied, ec);
       !ec && it != fs::recursive_directory_iterator(); it.increment(ec)) {
    if (!it->is_directory(ec) || it->is_symlink(ec)) continue;
    if (it->path().filename() == target + ".dir" && it->path().parent_path().filename() == "CMakeFiles") {
      out.push_back(it->path());
      it.disable_recursion_pending();
    }
  }
  return out;
}

// Object files compiled from sources: the device-link object of separable CUDA compilation is
// made from other objects, not from a source, and has no dependency record.
std::vector<fs::path> objects_in(const fs::path& dir) {
  std::vector<fs::path> out;
  std::error_code ec;
  for (auto it = fs::recursive_directory_iterator(dir, ec); !ec && it != fs::recursive_directory_iterator(); it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (it->is_regular_file(ec) && name.size() > 2 && name.ends_with(".o") && name != "cmake_device_link.o")
      out.push_back(it->path());
  }
  std::sort(out.begin(), out.end());
  return out;
}

// A recorded path made absolute, as written: `..` is left for resolved() to follow.
fs::path from_base(const std::string& p, const std::string& base) {
  fs::path path(p);
  return path.is_absolute() ? path : fs::path(base) / path;
}

}  // namespace

std::string Intake::problem_for(const ModuleSpec& m) const {
  for (const std::string& f : m.files)
    for (const IntakeFile& i : files)
      if (i.path == f && !i.problem.empty()) return f + ": " + i.problem;
  return "";
}

namespace {

// The course's files as a handout or a stage holds them (relative path -> the file): every
// regular file below `root` but in .git, build/, solutions/, out/ and lab/ (lab/ holds the research
// programs that compile the reference solutions into themselves, which tools/leakcheck.py fails a
// handout for; nothing in the build needs it), and none in a folder that holds `dest`, which would
// be copied into itself. No links: a linked file counts as its bytes, a linked folder (which could
// lead anywhere) not at all.
std::map<std::string, std::string> course_files(const std::string& root, const std::string& dest) {
  static const std::set<std::string> kSkip = {".git", "build", "solutions", "out", "lab"};
  const fs::path to = fs::weakly_canonical(fs::absolute(dest));
  std::map<std::string, std::string> files;
  for (const auto& entry : fs::directory_iterator(root)) {
    const fs::path top = entry.path();
    if (kSkip.count(top.filename().string())) continue;
    const auto rel = to.lexically_relative(fs::weakly_canonical(top));
    if (!rel.empty() && *rel.begin() != "..") continue;
    if (fs::is_regular_file(top)) files[top.filename().string()] = top.string();
    if (!fs::is_directory(entry.symlink_status())) continue;
    for (auto it = fs::recursive_directory_iterator(top); it != fs::recursive_directory_iterator(); ++it)
      if (it->is_regular_file()) files[(top.filename() / it->path().lexically_relative(top)).string()] = it->path().string();
  }
  return files;
}

bool same_bytes(const fs::path& a, const fs::path& b) {
  std::error_code ec;
  return fs::file_size(a, ec) == fs::file_size(b, ec) && !ec && read_bytes(a) == read_bytes(b);
}

}  // namespace


void sync_tree(const std::string& dest, const std::map<std::string, std::string>& files) {
  const fs::path to = fs::absolute(dest);
  std::set<std::string> dirs;
  for (const auto& [rel, from] : files)
    for (fs::path d = fs::path(rel).parent_path(); !d.empty(); d = d.parent_path()) dirs.insert(d.string());
  // The stage itself a link (or a file) would have everything below written where it leads.
  if (const fs::file_status st = fs::symlink_status(to); fs::exists(st) && !fs::is_directory(st)) fs::remove(to);
  fs::create_directories(to);
  // First whatever is there and not wanted as it is: a stray file, a folder where a file is
  // wanted, and every symbolic link (a link left in the stage would be written through below).
  std::vector<fs::path> unwanted;
  for (auto it = fs::recursive_directory_iterator(to); it != fs::recursive_directory_iterator(); ++it) {
    const std::string rel = it->path().lexically_relative(to).string();
    const fs::file_status st = it->symlink_status();
    const bool keep = fs::is_directory(st) ? dirs.count(rel) > 0 : fs::is_regular_file(st) && files.count(rel) > 0;
    if (keep) continue;
    unwanted.push_back(it->path());
    if (fs::is_directory(st)) it.disable_recursion_pending();
  }
  for (const fs::path& p : unwanted) fs::remove_all(p);
  // Then each file whose bytes differ, written anew; an unchanged one keeps its time stamp, so
  // that the build tree configured on the stage rebuilds only what changed.
  for (const auto& [rel, from] : files) {
    const fs::path at = to / rel;
    fs::create_directories(at.parent_path());
    if (!fs::exists(fs::symlink_status(at)) || !same_bytes(from, at))
      fs::copy_file(from, at, fs::copy_options::overwrite_existing);
    const fs::perms mode = fs::status(from).permissions() & fs::perms::mask;
    if ((fs::symlink_status(at).permissions() & fs::perms::mask) != mode) fs::permissions(at, mode);
  }
}

void copy_course(const std::string& root, const std::string& dest) { sync_tree(dest, course_files(root, dest)); }

bool is_within(const std::string& path, const std::string& dir) { return within(resolved(path), resolved(dir)); }

std::string staging_dir(const std::string& course_root, const std::string& build_dir) {
  const fs::path beside = fs::path(build_dir) / "staged";
  if (!is_within(beside.string(), course_root)) return fs::absolute(beside).string();
  // Inside the course tree, `#include "../../solutions/..."` from a staged file would reach the
  // reference solutions (or the tests): stage somewhere no relative path leads back from.
  std::error_code ec;
  std::vector<fs::path> temps;
  if (const fs::path t = fs::temp_directory_path(ec); !ec) temps.push_back(t);
  temps.push_back("/tmp");
  const std::string build_key = resolved(build_dir).string();
  char name[32];
  std::snprintf(name, sizeof name, "%016llx", static_cast<unsigned long long>(fnv1a(build_key.data(), build_key.size())));
  for (const fs::path& temp : temps) {
    const fs::path mine = temp / ("k2c-" + std::to_string(getuid()));
    if (is_within(mine.string(), course_root)) continue;
    // A folder of a shared /tmp is private to us only if we made it, or own it and it is no
    // link: another user's folder or link there could redirect what we stage.
    mkdir(mine.c_str(), 0711);
    struct stat st{};
    if (lstat(mine.c_str(), &st) != 0 || !S_ISDIR(st.st_mode) || st.st_uid != getuid())
      throw std::runtime_error("staging: " + mine.string() + " is not a directory owned by this user");
    // Searchable, not listable or writable, by others: the account that runs the tests compiles
    // the staged files (SECURITY row 28); no one else can put anything in it.
    chmod(mine.c_str(), 0711);
    return (mine / name / "staged").string();
  }
  throw std::runtime_error("staging: no folder outside the course tree to stage the submission in (set TMPDIR)");
}

Intake take_submission(const Rubric& rubric, const std::vector<const ModuleSpec*>& modules,
                       const std::string& submission_dir, const std::string& course_root,
                       const std::string& stage_dir) {
  if (!fs::is_directory(submission_dir))
    throw std::runtime_error("submission: " + submission_dir + " is not a directory");
  // The root itself may be reached through a link (an upload folder mounted elsewhere); below
  // it, nothing is.
  const fs::path sub = fs::canonical(submission_dir);

  Intake in;
  const fs::path stage = fs::absolute(stage_dir);
  in.staged_root = stage.string();
  // What the stage must hold: every file of the course, then the accepted student files in
  // place of theirs.
  std::map<std::string, std::string> staged = course_files(course_root, stage.string());

  // An accepted file's bytes are taken at once, right after its checks, into a folder of the
  // grader's beside the stage: what is staged is what was checked, whatever happens to the
  // submission folder while the rest of the intake runs.
  const fs::path taken = stage.string() + ".taken";
  fs::remove_all(taken);
  fs::create_directories(taken);
  fs::permissions(taken, fs::perms::owner_all);
  int taken_count = 0;

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
      Walk walk;
      for (const fs::path& rel : {fs::path(f), fs::path(f).filename()})
        if ((walk = walk_without_links(sub, rel)).exists) {
          found = sub / rel;
          break;
        }
      if (found.empty()) {  // the staged tree keeps the stub: graded as "not implemented yet"
        in.files.push_back(item);
        continue;
      }
      item.source = found.string();
      // A link anywhere on the way (a module folder linked to the course's solutions, say)
      // would be resolved on the grader's machine, where it can reach what the student cannot.
      if (!walk.link.empty()) {
        item.problem = "refused: " + walk.link + " is a symbolic link (to " + valid_utf8(walk.target) +
                       "); nothing is taken through a link";
        in.files.push_back(item);
        continue;
      }
      const fs::file_status st = fs::symlink_status(found);
      if (!fs::is_regular_file(st))
        item.problem = "refused: not a regular file";
      else if (fs::file_size(found) > rubric.max_file_bytes)
        item.problem = "refused: " + std::to_string(fs::file_size(found)) + " bytes, more than " +
                       std::to_string(rubric.max_file_bytes);
      else {
        const fs::path copy = taken / std::to_string(taken_count++);
        fs::copy_file(found, copy);
        // Readable by all, whatever its mode was: the account that runs the tests compiles it too.
        fs::permissions(copy, fs::perms::owner_read | fs::perms::owner_write | fs::perms::group_read |
                                  fs::perms::others_read, fs::perm_options::replace);
        staged[fs::path(f).lexically_normal().string()] = copy.string();
      }
      in.files.push_back(item);
    }
  }
  sync_tree(stage.string(), staged);
  fs::remove_all(taken);

  // Everything else in the submission is reported, never copied. The listing is for the student's
  // information and never costs the grade: it resolves no link (a link that loops, or points
  // nowhere, is a name like any other), skips what it may not read, stops where the walk fails,
  // and names kMaxIgnoredListed entries at most.
  constexpr std::size_t kMaxIgnoredListed = 200;
  std::size_t unlisted = 0;
  std::error_code ec;
  fs::recursive_directory_iterator it(sub, fs::directory_options::skip_permission_denied, ec);
  for (; !ec && it != fs::recursive_directory_iterator(); it.increment(ec)) {
    std::error_code status_ec;
    if (fs::is_directory(it->symlink_status(status_ec))) continue;
    const std::string rel = it->path().lexically_relative(sub).string();
    const bool named = wanted_rel.count(rel) ||
                       (rel.find('/') == std::string::npos && wanted_base.count(rel));
    if (named) continue;
    if (in.ignored.size() < kMaxIgnoredListed) in.ignored.push_back(valid_utf8(rel));
    else ++unlisted;
  }
  if (unlisted > 0) in.ignored.push_back("... and " + std::to_string(unlisted) + " more");
  if (ec) in.ignored.push_back("(the listing stopped here: " + ec.message() + ")");
  return in;
}

// ------------------------------------------------------------------- headers a build read ---

std::map<std::string, std::vector<std::string>> parse_ninja_deps(const std::string& text, const std::string& base) {
  // "obj: #deps 3, deps mtime 123 (VALID)" then one indented path per line; an object without
  // a record prints "obj: deps not found" and gets no entry.
  std::map<std::string, std::vector<std::string>> out;
  std::istringstream in(text);
  std::vector<std::string>* current = nullptr;
  for (std::string line; std::getline(in, line);) {
    if (line.empty()) continue;
    if (line[0] == ' ' || line[0] == '\t') {
      const auto start = line.find_first_not_of(" \t");
      if (current && start != std::string::npos) current->push_back(from_base(line.substr(start), base).string());
      continue;
    }
    current = nullptr;
    const auto colon = line.find(": #deps");
    if (colon != std::string::npos) current = &out[from_base(line.substr(0, colon), base).lexically_normal().string()];
  }
  return out;
}

std::vector<std::string> parse_make_depfile(const std::string& text, const std::string& base) {
  // "target: a b \<newline> c" (GCC) or "target : \<newline> a \<newline> ..." (nvcc); a space
  // inside a name is written "\ " and a dollar "$$".
  std::vector<std::string> out;
  std::string word;
  bool after_colon = false;
  auto flush = [&] {
    if (!word.empty() && after_colon) out.push_back(from_base(word, base).string());
    word.clear();
  };
  for (std::size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (c == '\\' && i + 1 < text.size() && (text[i + 1] == '\n' || text[i + 1] == '\r')) {
      flush();
      ++i;
    } else if (c == '\\' && i + 1 < text.size() && (text[i + 1] == ' ' || text[i + 1] == '#')) {
      word += text[++i];
    } else if (c == '$' && i + 1 < text.size() && text[i + 1] == '$') {
      word += '$';
      ++i;
    } else if (c == ':' && !after_colon && (i + 1 == text.size() || std::isspace(static_cast<unsigned char>(text[i + 1])))) {
      word.clear();  // the target
      after_colon = true;
    } else if (c == '\n' && after_colon) {
      flush();
      // GCC's -MP adds "header:" lines after the first rule: they repeat names, nothing new.
      break;
    } else if (std::isspace(static_cast<unsigned char>(c))) {
      flush();
    } else {
      word += c;
    }
  }
  flush();
  return out;
}

TargetDeps target_dependencies(const std::string& build_dir, const std::string& target) {
  TargetDeps deps;
  const fs::path build = fs::absolute(build_dir).lexically_normal();
  const std::vector<fs::path> dirs = target_dirs(build, target);
  deps.target_found = !dirs.empty();
  if (!deps.target_found) return deps;
  std::vector<fs::path> objects;
  for (const fs::path& d : dirs)
    for (const fs::path& o : objects_in(d)) objects.push_back(o);
  if (objects.empty()) {
    deps.error = "no object files of " + target + " in " + build.string();
    return deps;
  }

  const std::string cache = read_bytes(build / "CMakeCache.txt");
  const std::string generator = cache_value(cache, "CMAKE_GENERATOR");
  if (generator.find("Ninja") != std::string::npos) {
    // Ninja folds the compiler's .d files into its own log and deletes them; ask it.
    std::string program = cache_value(cache, "CMAKE_MAKE_PROGRAM");
    if (program.empty()) program = "ninja";
    std::vector<std::string> cmd = {program, "-C", build.string(), "-t", "deps"};
    for (const fs::path& o : objects) cmd.push_back(o.lexically_relative(build).string());
    const ProcessResult r = run_process(cmd, {.timeout_s = 120, .keep_head = std::size_t{1} << 26});
    if (r.exit_code != 0) {
      deps.error = "`ninja -t deps` failed (" + describe_exit(r, 120) + ")";
      return deps;
    }
    for (auto& [object, files] : parse_ninja_deps(r.output, build.string())) deps.objects[object] = std::move(files);
  } else {
    // The Makefile generator keeps the compiler's depfile beside each object.
    for (const fs::path& o : objects) {
      const fs::path d = o.string() + ".d";
      if (fs::exists(d)) deps.objects[o.lexically_normal().string()] = parse_make_depfile(read_bytes(d), build.string());
    }
  }
  for (const fs::path& o : objects) {
    const auto it = deps.objects.find(o.lexically_normal().string());
    if (it == deps.objects.end() || it->second.empty()) {
      deps.error = "no dependency record for " + o.lexically_relative(build).string() +
                   (generator.empty() ? "" : " (generator " + generator + ")");
      return deps;
    }
  }
  return deps;
}

std::vector<std::string> system_include_dirs(const std::string& build_dir) {
  std::vector<std::string> dirs = {"/usr/include", "/usr/lib/gcc"};
  std::error_code ec;
  // CMakeFiles/<cmake version>/CMake<LANG>Compiler.cmake, written when the compiler was probed:
  // set(CMAKE_CXX_IMPLICIT_INCLUDE_DIRECTORIES "/usr/include/c++/12;...").
  for (const auto& v : fs::directory_iterator(fs::path(build_dir) / "CMakeFiles", ec)) {
    if (!v.is_directory(ec)) continue;
    for (const char* lang : {"CXX", "CUDA", "C"}) {
      const std::string text = read_bytes(v.path() / ("CMake" + std::string(lang) + "Compiler.cmake"));
      for (const std::string& key : {std::string("CMAKE_") + lang + "_IMPLICIT_INCLUDE_DIRECTORIES",
                                    std::string("CMAKE_") + lang + "_TOOLKIT_INCLUDE_DIRECTORIES"}) {
        const auto at = text.find("set(" + key + " \"");
        if (at == std::string::npos) continue;
        const auto start = at + key.size() + 6, end = text.find('"', start);
        std::stringstream list(text.substr(start, end - start));
        for (std::string d; std::getline(list, d, ';');)
          if (!d.empty() && fs::path(d).is_absolute() && d != "/") dirs.push_back(d);
      }
    }
  }
  return dirs;
}

std::string include_outside(const TargetDeps& deps, const std::vector<std::string>& public_dirs,
                            const std::vector<std::string>& system_dirs,
                            const std::vector<std::string>& denied_dirs) {
  auto all_resolved = [](const std::vector<std::string>& v) {
    std::vector<fs::path> out;
    for (const std::string& d : v) out.push_back(resolved(d));
    return out;
  };
  const auto pub = all_resolved(public_dirs), sys = all_resolved(system_dirs), denied = all_resolved(denied_dirs);
  auto any_within = [](const fs::path& p, const std::vector<fs::path>& dirs) {
    return std::any_of(dirs.begin(), dirs.end(), [&](const fs::path& d) { return within(p, d); });
  };
  for (const auto& [object, files] : deps.objects) {
    if (files.empty()) continue;
    for (const std::string& f : files) {
      // Ninja stores paths with `..` struck out by name; a header that is not where the record
      // says was reached some other way (through a link and `..`), and is not vouched for.
      std::error_code ec;
      if (!fs::is_regular_file(f, ec)) return files.front() + " includes " + f + ", which is not a file there";
      const fs::path p = resolved(f);
      if (any_within(p, pub)) continue;
      if (any_within(p, sys) && !any_within(p, denied)) continue;
      // The first entry of a record is the source the object was compiled from; the header is
      // named where it really is, whatever detour the #include took.
      return files.front() + " includes " + p.string();
    }
  }
  return "";
}

// ------------------------------------------------------- libraries loaded at run time ---

LibraryFindings inspect_library(const std::string& path) {
  LibraryFindings f;
  const std::string data = read_bytes(path);
  // Bounds-checked little-endian reads: a malformed file ends the inspection, not the grader.
  struct Bad {};
  auto get = [&](std::uint64_t at, int bytes) -> std::uint64_t {
    if (at > data.size() || data.size() - at < static_cast<std::uint64_t>(bytes)) throw Bad{};
    std::uint64_t v = 0;
    for (int i = bytes - 1; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(data[at + i]);
    return v;
  };
  auto c_string = [&](std::uint64_t at) -> std::string {
    if (at >= data.size()) throw Bad{};
    const auto end = data.find('\0', at);
    if (end == std::string::npos) throw Bad{};
    return data.substr(at, end - at);
  };
  if (data.size() < 64 || data.compare(0, 4, "\x7f" "ELF") != 0 || data[4] != 2 || data[5] != 1) {
    f.error = "not a 64-bit little-endian ELF file";
    return f;
  }
  try {
    struct Section {
      std::uint32_t type, link;
      std::uint64_t offset, size, entsize;
    };
    const std::uint64_t shoff = get(0x28, 8), shentsize = get(0x3a, 2), shnum = get(0x3c, 2);
    if (shentsize < 64) throw Bad{};
    std::vector<Section> sections;
    for (std::uint64_t i = 0; i < shnum; ++i) {
      const std::uint64_t s = shoff + i * shentsize;
      sections.push_back({static_cast<std::uint32_t>(get(s + 4, 4)), static_cast<std::uint32_t>(get(s + 0x28, 4)),
                          get(s + 0x18, 8), get(s + 0x20, 8), get(s + 0x38, 8)});
    }
    constexpr std::uint32_t kDynamic = 6, kDynSym = 11;
    bool has_dynsym = false;
    for (const Section& s : sections) {
      if (s.type != kDynamic && s.type != kDynSym) continue;
      if (s.link >= sections.size()) throw Bad{};
      const std::uint64_t strtab = sections[s.link].offset;
      if (s.type == kDynSym) {  // Elf64_Sym: name u32, info, other, shndx u16, value, size
        has_dynsym = true;
        for (std::uint64_t at = s.offset; at + 24 <= s.offset + s.size; at += 24) {
          const std::uint64_t name = get(at, 4), binding = get(at + 4, 1) >> 4, shndx = get(at + 6, 2);
          if (name == 0 || shndx != 0) continue;
          f.undefined.push_back(c_string(strtab + name));
          if (binding == 2) f.weak_undefined.push_back(f.undefined.back());  // STB_WEAK
        }
      } else {  // Elf64_Dyn: tag i64, value u64; DT_NEEDED = 1, DT_NULL = 0 ends the table
        for (std::uint64_t at = s.offset; at + 16 <= s.offset + s.size; at += 16) {
          const std::uint64_t tag = get(at, 8);
          if (tag == 0) break;
          if (tag == 1) f.needed.push_back(c_string(strtab + get(at + 8, 8)));
        }
      }
    }
    if (!has_dynsym) f.error = "no dynamic symbol table";
  } catch (Bad) {
    f.error = "malformed ELF file";
    return f;
  }
  // A library's name spelled out in the binary is how code finds it to load it: the loader
  // calls themselves can be hidden (an address found by walking memory), the name rarely is.
  std::string lower(data.size(), '\0');
  std::transform(data.begin(), data.end(), lower.begin(), [](char c) { return static_cast<char>(std::tolower(static_cast<unsigned char>(c))); });
  for (const char* name : {"libcublas", "libcudnn", "cutlass", "libnccl", "libmpi"})
    if (lower.find(name) != std::string::npos) f.vendor_strings.push_back(name);
  return f;
}

std::string loader_calls(const LibraryFindings& f) {
  // The loader's entry points: with any of them, code can pull in a vendor library (or the
  // reference solution's) after the link check has passed.
  static const std::set<std::string> kLoader = {"dlopen", "dlmopen", "dlsym", "dlvsym", "dladdr", "dladdr1",
                                                "dlinfo", "dl_iterate_phdr", "_dl_find_object",
                                                "__libc_dlopen_mode", "__libc_dlsym"};
  std::string calls;
  for (const std::string& s : f.undefined) {
    const std::string base = s.substr(0, s.find('@'));
    if (kLoader.count(base) && calls.find(base) == std::string::npos) calls += (calls.empty() ? "" : ", ") + base;
  }
  return calls;
}

std::string runtime_loading_problem(const LibraryFindings& f, const std::vector<std::string>& linked) {
  if (!f.error.empty()) return "the implementation library could not be inspected (" + f.error + ")";
  // What a module's implementation is linked with: the C and C++ runtimes (and the maths,
  // vector-maths and atomics helpers the compiler may call) and the CUDA runtime.
  static const std::vector<std::string> kAllowed = {"libc.so.", "libm.so.", "libmvec.so.", "libstdc++.so.",
                                                    "libgcc_s.so.", "libatomic.so.", "libpthread.so.",
                                                    "librt.so.", "libcudart.so", "ld-linux",
                                                    "libk2c_model.so"};  // the course's model library (Part II)
  std::string why, links;
  const std::string calls = loader_calls(f);
  for (const std::string& n : f.needed)
    if (std::none_of(kAllowed.begin(), kAllowed.end(), [&](const std::string& a) { return n.rfind(a, 0) == 0; }) &&
        std::find(linked.begin(), linked.end(), n) == linked.end())
      links += (links.empty() ? "" : ", ") + n;
  if (!calls.empty()) why = "the implementation loads libraries at run time (" + calls + ")";
  if (!links.empty()) why += (why.empty() ? "" : "; ") + std::string("the implementation links ") + links;
  if (!f.vendor_strings.empty()) {
    std::string names;
    for (const std::string& n : f.vendor_strings) names += (names.empty() ? "" : ", ") + n;
    why += (why.empty() ? "" : "; ") + std::string("the implementation names vendor libraries (") + names + ")";
  }
  return why;
}

std::string weak_reference_problem(const LibraryFindings& f) {
  if (!f.error.empty()) return "";  // runtime_loading_problem says so
  // What compilers and the C and C++ runtimes leave weak in honest libraries: the start-up files'
  // profiling and transactional-memory hooks, GCC's transaction-safe clones of the C++ runtime's
  // operators new and delete (_ZGTtnam, _ZGTtdlPv: some libstdc++ builds leave them in every
  // library), the C++ ABI (__cxa_pure_virtual in the vtable of any abstract class, __cxa_finalize),
  // the threads library on older C libraries, and the sanitizers' runtimes. Whatever they bind to
  // is the C or C++ runtime: nothing that could compute a module's results.
  static const std::vector<std::string> kRuntimePrefixes = {"__gmon_start__", "_ITM_", "_ZGTt", "_Jv_", "__cxa_", "__gxx_",
                                                            "pthread_", "__pthread_", "__asan_", "__ubsan_",
                                                            "__tsan_", "__lsan_", "__sanitizer_"};
  std::string names;
  for (const std::string& s : f.weak_undefined) {
    const std::string base = s.substr(0, s.find('@'));
    const bool runtime = std::any_of(kRuntimePrefixes.begin(), kRuntimePrefixes.end(),
                                     [&](const std::string& prefix) { return base.rfind(prefix, 0) == 0; });
    if (!runtime && names.find(base) == std::string::npos) names += (names.empty() ? "" : ", ") + base;
  }
  if (names.empty()) return "";
  return "the implementation refers weakly to " + names +
         ", which binds at run time to whatever the test program has loaded (the link check cannot see it)";
}

// ------------------------------------------------------------------- course fingerprint ---

TreeWatch::TreeWatch(const std::string& root, const std::vector<std::string>& skip, const std::vector<std::string>& also)
    : root_(resolved(root).string()),
      watched_{".git", "autograder", "cmake", "common", "solutions", "CMakeLists.txt", "CMakePresets.json", "Makefile"} {
  std::random_device secret;
  key_ = (static_cast<std::uint64_t>(secret()) << 32 ^ secret()) | 1;
  const fs::path r(root_);
  skip_.push_back("build");
  for (const std::string& s : skip) {
    const fs::path p = resolved(s);
    if (within(p, r)) skip_.push_back(p.lexically_relative(r).string());
  }
  for (const std::string& a : also) {
    const fs::path p = resolved(a);
    if (within(p, r) && p != r) watched_.insert(p.lexically_relative(r).begin()->string());
  }
  // Build trees elsewhere in the course (build-debug/, a CLion folder): compilers write there
  // while we grade. Decided once, now: a CMakeCache.txt written later hides nothing.
  std::error_code ec;
  for (auto it = fs::recursive_directory_iterator(r, fs::directory_options::skip_permission_denied, ec);
       !ec && it != fs::recursive_directory_iterator(); it.increment(ec)) {
    if (it->path().filename() == ".git" || it->path().filename() == "build") {
      it.disable_recursion_pending();
      continue;
    }
    if (it->path().filename() == "CMakeCache.txt") skip_.push_back(it->path().parent_path().lexically_relative(r).string());
  }
  before_ = digest();
}

std::map<std::string, std::uint64_t> TreeWatch::digest() const {
  std::map<std::string, std::uint64_t> out;
  const fs::path r(root_);
  auto skipped = [&](const std::string& rel) {
    return std::any_of(skip_.begin(), skip_.end(), [&](const std::string& s) { return rel == s; });
  };
  // Only what a later grading reads (see the header): an editor's save in assignments/ must not
  // stop a grading that runs in place.
  // Depth first, by hand: each folder decides whether it is descended into.
  std::vector<fs::path> todo = {r};
  while (!todo.empty()) {
    const fs::path dir = todo.back();
    todo.pop_back();
    std::error_code ec;
    // Stepped with an error code: a folder that vanishes mid-walk ends its listing, not the grader.
    for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
      const fs::directory_entry& e = *it;
      const std::string rel = e.path().lexically_relative(r).string();
      const std::string parent = dir.lexically_relative(r).string();
      if (dir == r && !watched_.count(e.path().filename().string())) continue;
      if (parent == ".git" && e.path().filename() != "config" && e.path().filename() != "hooks") continue;
      const fs::file_status st = e.symlink_status(ec);
      if (fs::is_symlink(st)) {
        const std::string target = "link:" + fs::read_symlink(e.path(), ec).string();
        out[rel] = fnv1a(target.data(), target.size(), kFnvOffset ^ key_);
      } else if (fs::is_directory(st)) {
        if (!skipped(rel)) todo.push_back(e.path());
      } else if (fs::is_regular_file(st)) {
        std::ifstream in(e.path(), std::ios::binary);
        std::uint64_t h = kFnvOffset ^ key_;
        char buf[1 << 16];
        while (in.read(buf, sizeof buf) || in.gcount() > 0) h = fnv1a(buf, static_cast<std::size_t>(in.gcount()), h);
        out[rel] = in.bad() ? 0 : h;
      } else {
        out[rel] = 1;  // a fifo or a device: its presence is what counts
      }
    }
  }
  return out;
}

std::vector<std::string> TreeWatch::changes() const {
  const auto now = digest();
  std::vector<std::string> out;
  for (const auto& [path, h] : before_) {
    const auto it = now.find(path);
    if (it == now.end()) out.push_back(path + " (removed)");
    else if (it->second != h) out.push_back(path + " (changed)");
  }
  for (const auto& [path, h] : now)
    if (!before_.count(path)) out.push_back(path + " (added)");
  return out;
}

}  // namespace k2c::grader
