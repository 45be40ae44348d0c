// course_ops.cpp — CourseOps (k2c/model/course_ops.h): each operation by the course's kernel where
// it was found right at the shape, by the trusted backend otherwise.
#include "k2c/model/course_ops.h"

#include <algorithm>
#include <cstdint>
#include <cmath>
#include <cstdio>
#include <initializer_list>
#include <limits>
#include <sstream>
#include <utility>

#include "k2c/core/bf16.h"
#include "k2c/core/todo.h"

namespace k2c::model {

namespace {

// The operations a course kernel can take, in the order of the table.
const char* const kOps[] = {"matmul",    "grouped matmul", "grouped weight grad", "rmsnorm", "rmsnorm backward",
                            "rope",      "attention",      "attention backward"};
constexpr int kOpCount = sizeof kOps / sizeof kOps[0];

// t's values as fp32 on the host (a bf16 tensor widened, exactly).
std::vector<float> host_copy(Ops& ops, const Tensor& t) {
  std::vector<float> v(static_cast<std::size_t>(t.numel()));
  if (v.empty()) return v;
  if (t.dtype() != DType::bf16) {
    ops.download(v.data(), t);
    return v;
  }
  std::vector<std::uint16_t> half(v.size());
  ops.download(half.data(), t);
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = bf16_to_float(half[i]);
  return v;
}

std::string number(double x) {
  char b[32];
  std::snprintf(b, sizeof b, "%.4g", x);
  return b;
}

// How far `got` is from `want`, both the change a call made (for an output that adds, each minus
// the old contents). Empty when they agree within the tolerance, else what disagrees.
std::string disagreement(const std::vector<float>& got, const std::vector<float>& want, const std::vector<float>* before,
                         const CourseOps::Rules& tol, bool log, double& worst) {
  auto change = [&](const std::vector<float>& v, std::size_t i) {
    return before ? static_cast<double>(v[i]) - (*before)[i] : static_cast<double>(v[i]);
  };
  double largest = 0, sum_sq = 0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    const double w = change(want, i);
    if (std::isfinite(w)) largest = std::max(largest, std::fabs(w)), sum_sq += w * w;
  }
  double worst_abs = 0, diff_sq = 0;
  std::size_t worst_at = 0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    const double g = change(got, i), w = change(want, i);
    if (!std::isfinite(w)) {  // -inf of a query that sees no key: the same value is required
      if (!(g == w || (std::isnan(g) && std::isnan(w))))
        return "element " + std::to_string(i) + " is " + number(g) + " where the trusted backend has " + number(w);
      continue;
    }
    if (!std::isfinite(g))
      return "element " + std::to_string(i) + " is " + number(g) + " where the trusted backend has " + number(w);
    const double d = std::fabs(g - w);
    diff_sq += d * d;
    if (d > worst_abs) worst_abs = d, worst_at = i;
  }
  const double scale = largest > 0 ? largest : 1.0;
  worst = worst_abs / scale;
  const double l2 = sum_sq > 0 ? std::sqrt(diff_sq / sum_sq) : std::sqrt(diff_sq);
  if (log && worst_abs > tol.log_error)
    return "element " + std::to_string(worst_at) + " is " + number(change(got, worst_at)) + " where the trusted backend has " +
           number(change(want, worst_at)) + " (a logarithm: error " + number(worst_abs) + ", allowed " +
           number(tol.log_error) + ")";
  if (worst <= tol.max_error && l2 <= tol.l2_error) return "";
  return "element " + std::to_string(worst_at) + " is " + number(change(got, worst_at)) + " where the trusted backend has " +
         number(change(want, worst_at)) + " (error " + number(worst) + " of the largest value, allowed " +
         number(tol.max_error) + "; relative L2 error " + number(l2) + ", allowed " + number(tol.l2_error) + ")";
}

std::string shape_of(const Tensor& t) { return t.shape().str(); }
// The dtypes of a call's activations, where any is not fp32: a kernel checked on fp32 tensors has
// not been checked on bf16 ones, so they are part of the shape a check covers.
std::string dtypes(std::initializer_list<const Tensor*> ts) {
  std::string list;
  bool other = false;
  for (const Tensor* t : ts) {
    if (!t) continue;
    list += (list.empty() ? "" : " ") + to_string(t->dtype());
    other = other || t->dtype() != DType::f32;
  }
  return other ? " (" + list + ")" : "";
}

}  // namespace

CourseOps::CourseOps(Ops& trusted, CourseKernels kernels, Rules rules)
    : ForwardingOps(trusted), kernels_(std::move(kernels)), rules_(rules) {
  const bool present[kOpCount] = {bool(kernels_.matmul),           bool(kernels_.grouped_matmul),
                                  bool(kernels_.grouped_weight_grad), bool(kernels_.rmsnorm_forward),
                                  bool(kernels_.rmsnorm_backward), bool(kernels_.rope),
                                  bool(kernels_.attention_forward), bool(kernels_.attention_backward)};
  for (int i = 0; i < kOpCount; ++i) {
    Entry& e = entries_[kOps[i]];
    e.row.op = kOps[i];
    if (present[i]) {
      const auto name = kernels_.names.find(kOps[i]);
      e.row.kernel = name != kernels_.names.end() ? name->second : "(unnamed)";
    }
  }
}

std::vector<CourseOps::Row> CourseOps::table() const {
  std::vector<Row> rows;
  for (const char* op : kOps) rows.push_back(entries_.at(op).row);
  return rows;
}

std::string CourseOps::report() const {
  std::ostringstream s;
  char line[256];
  std::snprintf(line, sizeof line, "%-19s %-40s %-8s %8s %8s  %s\n", "operation", "course kernel", "ran", "course",
                "trusted", "note");
  s << line;
  for (const Row& r : table()) {
    const char* ran = r.kernel.empty() || !r.fallback.empty() ? "trusted" : r.course_calls ? "course" : "-";
    std::string note = r.kernel.empty() ? "no course kernel for this operation" : r.fallback;
    if (r.kernel.empty() && r.op.starts_with("grouped") && kernels_.matmul)
      note += ": one matmul per group, through the matmul row while that one runs";
    if (note.empty() && r.shapes_checked)
      note = "agreed at " + std::to_string(r.shapes_checked) + " shape" + (r.shapes_checked > 1 ? "s" : "") +
             ", largest error " + number(r.worst_error) + " of the largest value";
    if (r.fallback.empty() && r.unchecked_calls)
      note += "; then " + std::to_string(r.unchecked_calls) + " more call" + (r.unchecked_calls > 1 ? "s" : "") +
              " uncompared";
    if (r.fallback.empty() && r.shapes_declined)
      note += std::string(note.empty() ? "" : "; ") + "declined " + std::to_string(r.shapes_declined) + " shape" +
              (r.shapes_declined > 1 ? "s" : "") + " it does not take";
    if (!r.replaced.empty()) note += std::string(note.empty() ? "" : "; ") + "in place of " + r.replaced;
    std::snprintf(line, sizeof line, "%-19s %-40s %-8s %8ld %8ld  ", r.op.c_str(),
                  r.kernel.empty() ? "-" : r.kernel.c_str(), ran, r.course_calls, r.trusted_calls);
    s << line << note << "\n";
  }
  s << "every other operation: " << inner_.name() << "\n";
  return s.str();
}

void CourseOps::run(const std::string& op, bool has_kernel, const std::string& shape, const std::string& family,
                    std::vector<Out> outs, const std::function<bool()>& course, const std::function<void()>& trusted) {
  Entry& e = entries_.at(op);
  if (!has_kernel || !e.row.fallback.empty()) {
    trusted();
    ++e.row.trusted_calls;
    return;
  }
  const auto known = e.shapes.find(shape);
  if (known != e.shapes.end()) {
    if (known->second) {
      try {
        if (course()) {
          ++e.row.course_calls;
          return;
        }
      } catch (const std::exception& ex) {  // outputs half written: nothing to fall back on
        throw std::runtime_error("course kernel " + e.row.kernel + " threw at " + shape +
                                 ", a shape it had computed before: " + ex.what());
      }
    }
    trusted();
    ++e.row.trusted_calls;
    return;
  }
  // A new shape: compared with the trusted backend while its family (the same shape but for the
  // rows a MoE's routing varies) has fewer than rules_.checks agreeing shapes; after that run alone,
  // still guarded against a throw or a decline.
  attempt(e, shape, family, outs, course, trusted);
}

bool CourseOps::attempt(Entry& e, const std::string& shape, const std::string& family, const std::vector<Out>& outs,
                        const std::function<bool()>& course, const std::function<void()>& trusted) {
  const bool compare = e.families[family] < rules_.checks;
  auto copy_of = [&](const Tensor& t) {
    Tensor c(memory(), scratch_ledger_, Category::activations, t.shape(), t.dtype());
    inner_.copy(c, t);
    return c;
  };
  // The old contents of the outputs the operation reads (an in-place operation's input, an
  // accumulator's sum so far), so that the course kernel starts from what the trusted one did and
  // a failure can start the trusted one again; then the trusted results. An output written whole
  // needs no copy: a trusted call rewrites it (past a family's checks that saves, for a MoE's
  // expert outputs, a copy the size of the output at every call).
  std::vector<Tensor> before(outs.size()), want;
  for (std::size_t i = 0; i < outs.size(); ++i)
    if (outs[i].reads()) before[i] = copy_of(*outs[i].tensor);
  auto restore = [&] {  // the outputs as the call found them, the ones written whole poisoned
    for (std::size_t i = 0; i < outs.size(); ++i)
      if (outs[i].reads()) inner_.copy(*outs[i].tensor, before[i]);
      else inner_.fill(*outs[i].tensor, std::numeric_limits<float>::quiet_NaN());
  };
  if (compare) {
    trusted();
    for (const Out& o : outs) want.push_back(copy_of(*o.tensor));
    restore();
  }

  std::string failure;
  bool ran = false;
  try {
    ran = course();
  } catch (const NotImplemented&) {
    failure = "not implemented";
  } catch (const std::exception& ex) {
    failure = std::string("threw at ") + shape + ": " + ex.what();
  }
  double worst = 0;
  if (compare && failure.empty() && ran) {
    for (std::size_t i = 0; i < outs.size() && failure.empty(); ++i) {
      const std::vector<float> old = outs[i].adds ? host_copy(inner_, before[i]) : std::vector<float>{};
      double w = 0;
      const std::string d = disagreement(host_copy(inner_, *outs[i].tensor), host_copy(inner_, want[i]),
                                         outs[i].adds ? &old : nullptr, rules_, outs[i].log, w);
      if (!d.empty()) failure = "disagreed at " + shape + " (output " + std::to_string(i + 1) + "): " + d;
      worst = std::max(worst, w);
    }
  }
  if (!failure.empty()) {
    // The operation's next implementation, if the adapter has one, gets the same call, from the
    // same old contents, and is checked anew at every shape (what agreed was the other kernel).
    const auto next = kernels_.second_choice.find(e.row.op);
    const std::string name = next != kernels_.second_choice.end() && next->second ? next->second() : "";
    if (!name.empty() && name != e.row.kernel) {  // a kernel cannot stand in for itself
      e.row.replaced = e.row.kernel + ", which " + (failure == "not implemented" ? "is not implemented" : failure);
      e.row.kernel = name;
      e.row.shapes_checked = e.row.shapes_declined = 0;
      e.row.unchecked_calls = 0;
      e.row.worst_error = 0;
      e.shapes.clear();
      e.families.clear();
      restore();
      return attempt(e, shape, family, outs, course, trusted);
    }
  }
  if (!failure.empty() || !ran) {
    // The trusted results stand, whatever the course kernel wrote.
    if (compare) {
      for (std::size_t i = 0; i < outs.size(); ++i) inner_.copy(*outs[i].tensor, want[i]);
    } else {
      restore();
      trusted();
    }
    if (!failure.empty()) e.row.fallback = failure;
    else ++e.row.shapes_declined;
    ++e.row.trusted_calls;
    e.shapes[shape] = false;
    return false;
  }
  ++e.row.course_calls;
  if (!compare) {
    // Not remembered: a MoE meets a new split of its rows at nearly every call, and a table of
    // them would grow through the whole run. The next call at this shape comes here again.
    ++e.row.unchecked_calls;
    return true;
  }
  ++e.row.shapes_checked;
  e.row.worst_error = std::max(e.row.worst_error, worst);
  ++e.families[family];
  e.shapes[shape] = true;
  return true;
}

bool CourseOps::matmul_on() const { return kernels_.matmul && entries_.at("matmul").row.fallback.empty(); }

void CourseOps::matmul(const Tensor& a, bool ta, const Tensor& b, bool tb, Tensor& c, float alpha, float beta) {
  const std::string flags =
      std::string(beta != 0.0f ? " +=" : "") + (alpha != 1.0f ? " scaled" : "") + dtypes({&a, &b, &c});
  const std::string shape = shape_of(a) + (ta ? "T" : "") + " x " + shape_of(b) + (tb ? "T" : "") + flags;
  // The family: the shape without the rows of a and b, which a MoE's expert GEMMs vary.
  const std::string family = "[-, " + std::to_string(a.dim(a.rank() - 1)) + "]" + (ta ? "T" : "") + " x [-, " +
                             std::to_string(b.dim(b.rank() - 1)) + "]" + (tb ? "T" : "") + flags;
  run("matmul", bool(kernels_.matmul), shape, family, {{&c, beta != 0.0f}},
      [&] { return kernels_.matmul(a, ta, b, tb, c, alpha, beta); },
      [&] { inner_.matmul(a, ta, b, tb, c, alpha, beta); });
}

// The Linear layers' compound GEMMs: through the adapter's compound kernel where it has one (a
// single layer's backward as a list of one), else by their plain matmul calls (Ops's defaults), so
// that each goes through the course GEMM; by the trusted backend's fused forms when it does not run.
void CourseOps::linear_backward(const Tensor& x, const Tensor& w, const Tensor& dy, Tensor* dw, Tensor* dx) {
  if (!matmul_on()) return inner_.linear_backward(x, w, dy, dw, dx);
  if (!kernels_.shared_linear_backward) return Ops::linear_backward(x, w, dy, dw, dx);
  const Tensor* ws[] = {&w};
  const Tensor* dys[] = {&dy};
  Tensor* dws[] = {dw};
  shared_linear_backward(x, ws, dys, dws, dx);
}
// With the adapter's compound kernels, one call (a shape of its own in the matmul row: every
// weight, and which gradients it takes); without them, one matmul call per product.
void CourseOps::shared_linear_forward(const Tensor& x, std::span<const Tensor* const> ws, std::span<Tensor* const> ys) {
  if (!matmul_on()) return inner_.shared_linear_forward(x, ws, ys);
  if (!kernels_.shared_linear_forward) return Ops::shared_linear_forward(x, ws, ys);
  std::string shape = shape_of(x) + dtypes({&x}) + " x shared";
  std::vector<Out> outs;
  for (std::size_t i = 0; i < ws.size(); ++i) {
    shape += " " + shape_of(*ws[i]) + "T" + dtypes({ws[i], ys[i]});
    outs.push_back({ys[i], false});
  }
  run("matmul", true, shape, shape, outs, [&] { return kernels_.shared_linear_forward(x, ws, ys); },
      [&] { inner_.shared_linear_forward(x, ws, ys); });
}
void CourseOps::shared_linear_backward(const Tensor& x, std::span<const Tensor* const> ws,
                                       std::span<const Tensor* const> dys, std::span<Tensor* const> dws, Tensor* dx) {
  if (!matmul_on()) return inner_.shared_linear_backward(x, ws, dys, dws, dx);
  if (!kernels_.shared_linear_backward) return Ops::shared_linear_backward(x, ws, dys, dws, dx);
  std::string shape = "backward of " + shape_of(x) + dtypes({&x}) + " x shared";
  std::vector<Out> outs;
  for (std::size_t i = 0; i < ws.size(); ++i) {
    shape += " " + shape_of(*ws[i]) + "T" + dtypes({ws[i], dys[i], dws[i]}) + (dws[i] ? " dW" : "");
    if (dws[i]) outs.push_back({dws[i], true});
  }
  if (dx) outs.push_back({dx, false}), shape += " dx" + dtypes({dx});
  run("matmul", true, shape, shape, outs, [&] { return kernels_.shared_linear_backward(x, ws, dys, dws, dx); },
      [&] { inner_.shared_linear_backward(x, ws, dys, dws, dx); });
}

namespace {
// A grouped call's family, for the check budget: the weights' shape and how many groups from
// which; not a's rows, nor how they split into groups, which a MoE's routing changes every call.
std::string grouped_family(std::span<const std::int64_t> offsets, int first, const Tensor& w) {
  return " x " + w.shape().str() + ", " + std::to_string(offsets.size() - 1) + " groups from " + std::to_string(first);
}
// Its key: the family, a's shape and the rows of each group (a digest of the offsets), since a
// kernel can be right for one split of the rows and wrong for another.
std::string grouped_key(const Tensor& a, std::span<const std::int64_t> offsets, int first, const Tensor& w) {
  std::uint64_t digest = 14695981039346656037ull;  // FNV-1a over the offsets
  for (const std::int64_t o : offsets) digest = (digest ^ static_cast<std::uint64_t>(o)) * 1099511628211ull;
  char split[24];
  std::snprintf(split, sizeof split, "%016llx", static_cast<unsigned long long>(digest));
  return a.shape().str() + grouped_family(offsets, first, w) + ", split " + split;
}
}  // namespace

// Without a grouped kernel, while the course GEMM runs, the groups go through it one at a time
// (Ops's defaults: a matmul per group, counted in the matmul row).
void CourseOps::grouped_matmul(const Tensor& a, std::span<const std::int64_t> offsets, int first, const Tensor& w,
                               bool transpose_w, Tensor& c) {
  if (!kernels_.grouped_matmul && matmul_on()) return Ops::grouped_matmul(a, offsets, first, w, transpose_w, c);
  const std::string t = (transpose_w ? " T" : "") + dtypes({&a, &w, &c});
  run("grouped matmul", bool(kernels_.grouped_matmul), grouped_key(a, offsets, first, w) + t,
      grouped_family(offsets, first, w) + t, {{&c, false}},
      [&] { return kernels_.grouped_matmul(a, offsets, first, w, transpose_w, c); },
      [&] { inner_.grouped_matmul(a, offsets, first, w, transpose_w, c); });
}
void CourseOps::grouped_weight_grad(const Tensor& dy, const Tensor& x, std::span<const std::int64_t> offsets,
                                    int first, Tensor& dw) {
  if (!kernels_.grouped_weight_grad && matmul_on()) return Ops::grouped_weight_grad(dy, x, offsets, first, dw);
  const std::string t = dtypes({&dy, &x, &dw});
  run("grouped weight grad", bool(kernels_.grouped_weight_grad), grouped_key(dy, offsets, first, dw) + t,
      grouped_family(offsets, first, dw) + t, {{&dw, true}},
      [&] { return kernels_.grouped_weight_grad(dy, x, offsets, first, dw); },
      [&] { inner_.grouped_weight_grad(dy, x, offsets, first, dw); });
}

void CourseOps::rmsnorm_forward(const Tensor& x, const Tensor& g, float eps, Tensor& y, Tensor& rstd) {
  const std::string shape = shape_of(x) + dtypes({&x, &y});
  run("rmsnorm", bool(kernels_.rmsnorm_forward), shape, shape, {{&y, false}, {&rstd, false}},
      [&] { return kernels_.rmsnorm_forward(x, g, eps, y, rstd); }, [&] { inner_.rmsnorm_forward(x, g, eps, y, rstd); });
}
void CourseOps::rmsnorm_backward(const Tensor& x, const Tensor& g, const Tensor& rstd, const Tensor& dy, Tensor& dx,
                                 Tensor& dg) {
  const std::string shape = shape_of(x) + dtypes({&x, &dy, &dx});
  run("rmsnorm backward", bool(kernels_.rmsnorm_backward), shape, shape, {{&dx, false}, {&dg, true}},
      [&] { return kernels_.rmsnorm_backward(x, g, rstd, dy, nullptr, dx, dg); },
      [&] { inner_.rmsnorm_backward(x, g, rstd, dy, dx, dg); });
}
void CourseOps::rmsnorm_backward_add(const Tensor& x, const Tensor& g, const Tensor& rstd, const Tensor& dy,
                                     const Tensor& r, Tensor& dx, Tensor& dg) {
  const std::string shape = shape_of(x) + " + residual" + dtypes({&x, &dy, &r, &dx});
  run("rmsnorm backward", bool(kernels_.rmsnorm_backward), shape, shape, {{&dx, false}, {&dg, true}},
      [&] { return kernels_.rmsnorm_backward(x, g, rstd, dy, &r, dx, dg); },
      [&] { inner_.rmsnorm_backward_add(x, g, rstd, dy, r, dx, dg); });
}

void CourseOps::rope(Tensor& x, const Tensor& positions, int heads, int hd, float theta, bool inverse) {
  const std::string shape = shape_of(x) + dtypes({&x}) + " heads " + std::to_string(heads) + (inverse ? " inverse" : "");
  run("rope", bool(kernels_.rope), shape, shape, {{&x, false, false, true}},
      [&] { return kernels_.rope(x, positions, heads, hd, theta, inverse); },
      [&] { inner_.rope(x, positions, heads, hd, theta, inverse); });
}

namespace {
std::string attention_key(const AttentionShape& s) {
  std::ostringstream k;
  k << "batch " << s.batch << " q " << s.q_len << " kv " << s.kv_len << " heads " << s.q_heads << "/" << s.kv_heads
    << " d " << s.head_dim << (s.causal ? " causal" : "") << " offsets " << s.q_offset << "/" << s.kv_offset;
  return k.str();
}
}  // namespace

void CourseOps::attention_forward(const AttentionShape& s, const Tensor& q, const Tensor& k, const Tensor& v, Tensor& o,
                                  Tensor& lse) {
  const std::string key = attention_key(s) + dtypes({&q, &k, &v, &o});
  run("attention", bool(kernels_.attention_forward), key, key, {{&o, false}, {&lse, false, true}},
      [&] { return kernels_.attention_forward(s, q, k, v, o, lse); },
      [&] { inner_.attention_forward(s, q, k, v, o, lse); });
}
void CourseOps::attention_backward(const AttentionShape& s, const Tensor& q, const Tensor& k, const Tensor& v,
                                   const Tensor& o, const Tensor& lse, const Tensor& dout, Tensor& dq, Tensor& dk,
                                   Tensor& dv) {
  const std::string key = attention_key(s) + dtypes({&q, &k, &v, &o, &dout, &dq, &dk, &dv});
  run("attention backward", bool(kernels_.attention_backward), key, key, {{&dq, false}, {&dk, true}, {&dv, true}},
      [&] { return kernels_.attention_backward(s, q, k, v, o, lse, dout, dq, dk, dv, true); },
      [&] { inner_.attention_backward(s, q, k, v, o, lse, dout, dq, dk, dv); });
}
// The adapter's other path (dk and dv written): a shape of its own, checked on its own.
void CourseOps::attention_backward_overwrite(const AttentionShape& s, const Tensor& q, const Tensor& k,
                                             const Tensor& v, const Tensor& o, const Tensor& lse, const Tensor& dout,
                                             Tensor& dq, Tensor& dk, Tensor& dv) {
  const std::string key = attention_key(s) + dtypes({&q, &k, &v, &o, &dout, &dq, &dk, &dv}) + " dk, dv written";
  run("attention backward", bool(kernels_.attention_backward), key, key, {{&dq, false}, {&dk, false}, {&dv, false}},
      [&] { return kernels_.attention_backward(s, q, k, v, o, lse, dout, dq, dk, dv, false); },
      [&] { inner_.attention_backward_overwrite(s, q, k, v, o, lse, dout, dq, dk, dv); });
}

}  // namespace k2c::model
