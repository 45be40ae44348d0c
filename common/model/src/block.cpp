// block.cpp — see k2c/model/block.h.
#include "k2c/model/block.h"

namespace k2c::model {

// ---------------------------------------------------------------------------------------------
// Block

Block::Block(ParamList& params, const std::string& name, const BlockConfig& c, int index)
    : config_(c), index_(index), norm1_(params, name + ".norm1", c.attention.d_model, c.norm_eps),
      norm2_(params, name + ".norm2", c.attention.d_model, c.norm_eps),
      attn_(params, name + ".attn", c.attention), is_moe_(c.moe.experts > 0) {
  if (is_moe_)
    moe_ = Moe(params, name + ".moe", c.moe);
  else
    mlp_ = Mlp(params, name + ".mlp", c.attention.d_model, c.d_ff);
}

namespace {
// Residual dropout's key: two sites per block, masks over the global batch's rows.
DropoutKey residual_key(const DropoutKey& base, int block, int site) {
  DropoutKey k = base;
  k.layer = static_cast<std::uint64_t>(2 * block + site);
  return k;
}
}  // namespace

void Block::run_forward(Context& ctx, const Tensor& x, const Tensor& positions, int batch,
                        const DropoutKey& base, Internals& in, Tensor& out) const {
  const Shape shape = x.shape();
  // The norms' outputs feed GEMMs only: in the run's activation dtype (the MoE layer's input stays
  // fp32). So do the branches' outputs, which feed only the add into the residual stream: a bf16
  // GEMM's result lands in them with no conversion pass, and the add reads half the bytes. They
  // stay fp32 where dropout (fp32 only) runs on them, and for the MoE layer, which sums its
  // experts' rows into its output. The residual stream itself (x, h, out) is in ctx.residual.
  const bool narrow_branches = ctx.dropout == 0;
  in.n1 = ctx.activation(shape);
  in.h = ctx.residual_stream(shape);
  in.n2 = is_moe_ ? ctx.tensor(shape) : ctx.activation(shape);
  in.attn_out = narrow_branches ? ctx.activation(shape) : ctx.tensor(shape);
  in.mlp_out = narrow_branches && !is_moe_ ? ctx.activation(shape) : ctx.tensor(shape);
  norm1_.forward(ctx, x, in.n1, in.norm1);
  attn_.forward(ctx, in.n1, positions, batch, in.attn_out, in.attn);
  if (ctx.dropout > 0) ctx.ops.dropout(in.attn_out, ctx.dropout, residual_key(base, index_, 0), in.attn_out);
  ctx.ops.add(x, in.attn_out, in.h);
  norm2_.forward(ctx, in.h, in.n2, in.norm2);
  if (is_moe_)
    moe_.forward(ctx, in.n2, in.mlp_out, in.moe);
  else
    mlp_.forward(ctx, in.n2, in.mlp_out, in.mlp);
  if (ctx.dropout > 0) ctx.ops.dropout(in.mlp_out, ctx.dropout, residual_key(base, index_, 1), in.mlp_out);
  ctx.ops.add(in.h, in.mlp_out, out);
}

void Block::forward(Context& ctx, const Tensor& x, const Tensor& positions, int batch, bool checkpoint,
                    Saved& saved) const {
  saved.out = ctx.residual_stream(x.shape());
  saved.internals = std::make_unique<Internals>();
  saved.dropout = {ctx.seed, ctx.step, 0, ctx.row_offset, 0, -1};
  run_forward(ctx, x, positions, batch, saved.dropout, *saved.internals, saved.out);
  if (checkpoint) saved.internals.reset();
}

void Block::backward(Context& ctx, const Tensor& x, const Tensor& positions, int batch, Saved& saved,
                     const Tensor& dout, Tensor& dx) const {
  if (!saved.internals) {  // checkpointed: recompute this block's forward from its input
    saved.internals = std::make_unique<Internals>();
    Tensor again = ctx.residual_stream(x.shape());
    const double aux = ctx.aux_loss;  // the recomputation must not count the balance term twice
    run_forward(ctx, x, positions, batch, saved.dropout, *saved.internals, again);
    ctx.aux_loss = aux;
  }
  Internals& in = *saved.internals;
  const Shape shape = x.shape();
  // out = h + drop(mlp(norm2(h)))
  // Without dropout a branch's output gradient is the residual's own: used as it is, not copied.
  Tensor dropped = ctx.dropout > 0 ? ctx.tensor(shape) : Tensor(), dh = ctx.residual_stream(shape);
  Tensor dn = ctx.tensor(shape, Category::activations, in.n2.dtype());  // the norms' output gradients
  if (ctx.dropout > 0) ctx.ops.dropout(dout, ctx.dropout, residual_key(saved.dropout, index_, 1), dropped);
  const Tensor& g_mlp = ctx.dropout > 0 ? dropped : dout;
  if (is_moe_ && g_mlp.dtype() != DType::f32) {  // the MoE layer takes its output's gradient in fp32
    Tensor wide = ctx.tensor(shape);
    ctx.ops.copy(wide, g_mlp);
    moe_.backward(ctx, in.n2, in.moe, wide, dn);
  } else if (is_moe_) {
    moe_.backward(ctx, in.n2, in.moe, g_mlp, dn);
  } else {
    mlp_.backward(ctx, in.n2, in.mlp, g_mlp, dn);
  }
  norm2_.backward(ctx, in.h, in.norm2, dn, dh, &dout);  // dh = through the norm + around it
  // h = x + drop(attn(norm1(x)))
  if (ctx.dropout > 0) ctx.ops.dropout(dh, ctx.dropout, residual_key(saved.dropout, index_, 0), dropped);
  const Tensor& g_attn = ctx.dropout > 0 ? dropped : dh;
  attn_.backward(ctx, in.n1, positions, batch, in.attn, g_attn, dn);
  norm1_.backward(ctx, x, in.norm1, dn, dx, &dh);
  saved.internals.reset();  // backward is done with them
}

}  // namespace k2c::model
