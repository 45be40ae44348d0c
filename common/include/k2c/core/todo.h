// k2c/core/todo.h — K2C_TODO and k2c::NotImplemented.
//
// Every unfinished function in a student stub calls K2C_TODO("what to write"). It throws
// k2c::NotImplemented, whose message starts with a fixed marker that the grader recognises and
// reports as "not implemented yet" instead of as a failure or a crash.
#pragma once

#include <stdexcept>
#include <string>

namespace k2c {

// The grader looks for this marker in failure messages; keep it stable.
inline constexpr const char* kNotImplementedMarker = "[k2c: not implemented]";

class NotImplemented : public std::logic_error {
 public:
  NotImplemented(const std::string& what, const char* file, int line)
      : std::logic_error(std::string(kNotImplementedMarker) + " " + what + " (" + file + ":" +
                         std::to_string(line) + ")") {}
};

}  // namespace k2c

#define K2C_TODO(what) throw ::k2c::NotImplemented((what), __FILE__, __LINE__)
