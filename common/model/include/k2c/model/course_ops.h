// k2c/model/course_ops.h — "course mode": the model's operations computed by the course's own
// kernels (a student's modules 05, 07, 08, 09 and 10) where they exist and are right, by the trusted
// backend everywhere else, with a table saying which ran.
//
// CourseOps wraps a trusted backend. For each operation it may hold a course kernel: a function
// with the operation's arguments that computes it (returning true), declines a shape it does not
// take (returning false: 09 takes head_dim 64 and 128 only), or throws (k2c::NotImplemented from a
// stub, anything else from a fault). The first call of an operation at each shape is a check: the
// trusted backend computes the outputs, the course kernel computes them again from the same
// inputs, and the two are compared; the run goes on with the course kernel's outputs only when they
// agree. A kernel that throws or disagrees once is never called again (its outputs are replaced by
// the trusted ones, so nothing it wrote survives), and the table names the reason. Later calls at
// a checked shape run the course kernel alone: the check costs one extra call per shape, and a
// dense model's step calls each operation at the same few shapes every time. A MoE's expert GEMMs
// meet new rows at every call (a grouped call's shape includes how its rows split into groups),
// so checks stop once `checks` shapes of a family (the same shape but for those rows) have
// agreed: from then on a new shape of that family runs the course kernel uncompared (a throw or a
// decline there still leaves the trusted result), and the table counts those calls without
// remembering their shapes (a declined shape is remembered, so that the kernel is not asked again).
// A kernel that throws at a shape it had computed before ends the run with
// that message: its outputs are half written and nothing is kept to fall back on.
//
// Agreement is judged on what the call changed (for an output the operation adds into, the
// difference from its old contents): no NaN or infinity the trusted result does not have, every
// element within `max_error` of the largest trusted value, and the whole within `l2_error`
// relative (root of the summed squares). Both default to what two bf16 computations of one
// quantity differ by, and no more (see the tests in tests/test_course_ops.cpp). A logarithm
// (attention's log-sum-exp, which the backward pass exponentiates) must also be within
// `log_error` of the trusted value, element by element: relative to its largest value a constant
// bias of 0.05 would pass, and it would scale every attention weight by 5 %.
//
// The kernels themselves (adapters between the model's fp32 tensors and a module's bf16 contract)
// live with the program that links the student's libraries: autograder/18_capstone/course_kernels.
#pragma once

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "k2c/model/forwarding_ops.h"

namespace k2c::model {

// One optional course kernel per operation; `names` says which module's function each one is.
struct CourseKernels {
  std::function<bool(const Tensor& a, bool ta, const Tensor& b, bool tb, Tensor& c, float alpha, float beta)> matmul;
  // Several Linear layers that read one input (Ops::shared_linear_forward, shared_linear_backward),
  // with the matmul kernel's GEMM: the adapter can convert that input once. Used, and checked as
  // the matmul row, while the matmul kernel runs; without them each product goes through matmul.
  std::function<bool(const Tensor& x, std::span<const Tensor* const> ws, std::span<Tensor* const> ys)>
      shared_linear_forward;
  std::function<bool(const Tensor& x, std::span<const Tensor* const> ws, std::span<const Tensor* const> dys,
                     std::span<Tensor* const> dws, Tensor* dx)>
      shared_linear_backward;
  // The MoE layer's grouped GEMMs (Ops::grouped_matmul, Ops::grouped_weight_grad: dw +=). Without
  // them, and while the matmul kernel runs, each group goes through the matmul kernel.
  std::function<bool(const Tensor& a, std::span<const std::int64_t> offsets, int first, const Tensor& w,
                     bool transpose_w, Tensor& c)>
      grouped_matmul;
  std::function<bool(const Tensor& dy, const Tensor& x, std::span<const std::int64_t> offsets, int first, Tensor& dw)>
      grouped_weight_grad;
  std::function<bool(const Tensor& x, const Tensor& gamma, float eps, Tensor& y, Tensor& rstd)> rmsnorm_forward;
  // dgamma += (as Ops::rmsnorm_backward); residual_dy, when given, is added into dx.
  std::function<bool(const Tensor& x, const Tensor& gamma, const Tensor& rstd, const Tensor& dy,
                     const Tensor* residual_dy, Tensor& dx, Tensor& dgamma)>
      rmsnorm_backward;
  std::function<bool(Tensor& x, const Tensor& positions, int heads, int head_dim, float theta, bool inverse)> rope;
  std::function<bool(const AttentionShape& s, const Tensor& q, const Tensor& k, const Tensor& v, Tensor& o, Tensor& lse)>
      attention_forward;
  // dq written, dk and dv added into where add_kv (as Ops::attention_backward), else written (as
  // Ops::attention_backward_overwrite).
  std::function<bool(const AttentionShape& s, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& o,
                     const Tensor& lse, const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv, bool add_kv)>
      attention_backward;
  std::map<std::string, std::string> names;  // operation → "09 flash_attention::forward_hopper"
  // operation → switches that operation's kernel to the module's next implementation (its Part A
  // after its Hopper part) and returns the new one's name, or "" when there is none (or when the
  // failing call did not run the part that would be replaced). Called when the kernel throws or
  // disagrees, so that a wrong Hopper part does not hide a right Part A.
  std::map<std::string, std::function<std::string()>> second_choice;
};

class CourseOps final : public ForwardingOps {
 public:
  struct Rules {
    double max_error = 3e-2, l2_error = 1e-2;  // the tolerances above
    int checks = 16;                           // agreeing shapes per family before checks stop
    double log_error = 1e-2;                   // a logarithm's elements, absolute: exp of it within 1 %
  };
  CourseOps(Ops& trusted, CourseKernels kernels, Rules rules);
  CourseOps(Ops& trusted, CourseKernels kernels) : CourseOps(trusted, std::move(kernels), Rules{}) {}

  std::string name() const override { return "course kernels over " + inner_.name(); }

  // What ran, per operation, so far.
  struct Row {
    std::string op, kernel;     // kernel: empty when the course has none for this operation
    long course_calls = 0, trusted_calls = 0;  // over the run (a replaced kernel's calls included)
    int shapes_checked = 0;     // shapes at which the course kernel agreed
    int shapes_declined = 0;    // shapes it does not take (the trusted backend runs them)
    long unchecked_calls = 0;   // uncompared calls: at shapes first met after their family's checks stopped
    double worst_error = 0;     // the largest per-element error of those checks (of the largest value)
    std::string fallback;       // why the trusted backend took over ("" while the course kernel runs)
    std::string replaced;       // the kernel that ran before `kernel` and why it was replaced ("" if none)
  };
  std::vector<Row> table() const;
  // The table as text: one line per operation, "op  kernel  ran  calls  note".
  std::string report() const;

  void matmul(const Tensor& a, bool ta, const Tensor& b, bool tb, Tensor& c, float alpha, float beta) override;
  void linear_backward(const Tensor& x, const Tensor& w, const Tensor& dy, Tensor* dw, Tensor* dx) override;
  void shared_linear_forward(const Tensor& x, std::span<const Tensor* const> ws, std::span<Tensor* const> ys) override;
  void shared_linear_backward(const Tensor& x, std::span<const Tensor* const> ws, std::span<const Tensor* const> dys,
                              std::span<Tensor* const> dws, Tensor* dx) override;
  void grouped_matmul(const Tensor& a, std::span<const std::int64_t> offsets, int first, const Tensor& w,
                      bool transpose_w, Tensor& c) override;
  void grouped_weight_grad(const Tensor& dy, const Tensor& x, std::span<const std::int64_t> offsets, int first,
                           Tensor& dw) override;
  void rmsnorm_forward(const Tensor& x, const Tensor& g, float eps, Tensor& y, Tensor& rstd) override;
  void rmsnorm_backward(const Tensor& x, const Tensor& g, const Tensor& rstd, const Tensor& dy, Tensor& dx,
                        Tensor& dg) override;
  void rmsnorm_backward_add(const Tensor& x, const Tensor& g, const Tensor& rstd, const Tensor& dy, const Tensor& r,
                            Tensor& dx, Tensor& dg) override;
  void rope(Tensor& x, const Tensor& positions, int heads, int hd, float theta, bool inverse) override;
  void attention_forward(const AttentionShape& s, const Tensor& q, const Tensor& k, const Tensor& v, Tensor& o,
                         Tensor& lse) override;
  void attention_backward(const AttentionShape& s, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& o,
                          const Tensor& lse, const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv) override;
  void attention_backward_overwrite(const AttentionShape& s, const Tensor& q, const Tensor& k, const Tensor& v,
                                    const Tensor& o, const Tensor& lse, const Tensor& dout, Tensor& dq, Tensor& dk,
                                    Tensor& dv) override;

 private:
  // An output of a call: `adds` when the operation adds into it (judged on what it added);
  // `in_place` when its old contents are the operation's input (RoPE's x); `log` when it is a
  // logarithm (attention's log-sum-exp), judged by Rules::log_error in absolute terms as well,
  // since an error there scales everything computed from it. An output that is neither adds nor
  // in_place is poisoned with NaN before the course kernel's checked call, so that an element it
  // does not write fails the check whatever the buffer held before.
  struct Out {
    Tensor* tensor;
    bool adds;
    bool log = false;
    bool in_place = false;
    bool reads() const { return adds || in_place; }
  };
  struct Entry {
    Row row;
    std::map<std::string, bool> shapes;   // shape → course kernel used there (false: declined)
    std::map<std::string, int> families;  // family → shapes of it that agreed
  };
  // Runs one call: the course kernel where it is (or is to be found) right, else the trusted one.
  // `family` is the shape without what a MoE's routing varies (the rows), for the check budget.
  void run(const std::string& op, bool has_kernel, const std::string& shape, const std::string& family,
           std::vector<Out> outs, const std::function<bool()>& course, const std::function<void()>& trusted);
  // The first call at a shape: the course kernel from the outputs' old contents, compared with the
  // trusted backend while the family's budget lasts; a throw or a decline leaves the trusted
  // results, and a throw or a disagreement tries the operation's second choice first. Records
  // the shape and returns whether the course kernel's outputs stand.
  bool attempt(Entry& e, const std::string& shape, const std::string& family, const std::vector<Out>& outs,
               const std::function<bool()>& course, const std::function<void()>& trusted);
  bool matmul_on() const;

  CourseKernels kernels_;
  Rules rules_;
  std::map<std::string, Entry> entries_;
  std::vector<std::string> order_;  // operations in order of first call, for the table
  MemoryLedger scratch_ledger_;     // the check's copies (freed at once; never in the model's ledger)
};

}  // namespace k2c::model
