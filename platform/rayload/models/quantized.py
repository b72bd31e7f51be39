"""int8 models for CPU serving: dynamic int8 linear layers and weight-only int8 embedding tables.

Engine choice (measured, see benchmarks/bench_compress.py and the probe in RESULTS.md): the
linear layers run on PyTorch's own dynamic int8 kernel (`quantized::linear_dynamic`, fbgemm on
x86 or qnnpack on ARM: int8 weights, activations quantized per batch, int32 accumulation). torchao 0.18's
Int8DynamicActivationInt8Weight on CPU runs as a tensor subclass in eager mode and measured
16x *slower* than fp32 at batch 1 and 0.89x at batch 256 (it needs torch.compile to fuse,
which a serving replica would have to pay per batch shape); PyTorch's kernels measured 2.8x
faster at batch 256. The embedding tables are int8 rows plus a float scale per row, looked
up by PyTorch's fused byte-rowwise embedding-bag kernel (about 4x less memory, lookups as fast
as fp32's).

On disk everything is plain tensors (int8 weights, float scales, biases) in `model.pt`, which
loads with `torch.load(weights_only=True)`; the fbgemm packed weights are built at load time
from them, so no packed or pickled object is ever stored. Quantization is symmetric per output
channel (linear, 7 bits: see Int8Linear) or per row (embeddings, 8 bits): scale = max|w| / limit, q = round(w / scale).

An int8 model's score of a row depends slightly on the batch it is scored in: Int8Linear
quantizes its input activations per call, from that batch's min and max, so the rows batched
beside a row move its rounding (measured: logits up to about 4e-3 apart between a row scored
alone and in a 4096-row batch, on the MLP and DCN; 1e-4 on DeepFM). What inference.py checks
(traced = eager within 1e-6 on the same batch) therefore makes a served fp32 score equal its
offline prediction, and a served int8 score equal it within the int8 tolerance (README,
"Compression"; tests/unit/test_quantized.py), not within 1e-6. An outlier in the batch is held
to the calibration range (InputRanges), so it cannot move the other rows' scores beyond that.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

# Linear layers smaller than this stay fp32: the first-order Linear over raw dense features and
# the 1-unit output layers weigh nothing and save nothing, but quantizing their inputs per batch
# (7-bit activations on fbgemm) measured most of the AUC loss on small models.
MIN_INT8_WEIGHTS = 1024
# The packed row the int8 lookup kernel reads holds `dim` codes plus an fp32 scale and bias
# (dim + 8 bytes) against 4 * dim bytes in fp32, so only tables of dim >= 3 get smaller in
# memory. Narrower ones (the first-order weights of DeepFM and Wide&Deep, dim 1) stay fp32: as
# int8 they took 2.25x the memory when loaded and their lookups were slower (MovieLens DeepFM,
# the first-order part at batch 1 / 32 / 256: 97 / 108 / 115 us as int8, 70 / 86 / 88 us in
# fp32), for a saving on disk of 3 bytes per ID.
MIN_INT8_EMBEDDING_DIM = 3


def quantize_rows(w: torch.Tensor, per_row: bool = True, limit: int = 127) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 values in [-limit, limit], float32 scales) of a 2-D weight, symmetric per row (or per tensor)."""
    w = w.detach().float()
    peak = w.abs().amax(dim=1) if per_row else w.abs().max().reshape(1)
    scale = torch.where(peak > 0, peak / limit, torch.ones_like(peak))
    q = torch.round(w / (scale.unsqueeze(1) if per_row else scale)).clamp(-limit, limit).to(torch.int8)
    return q, scale


def _pack_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fbgemm's byte-rowwise layout: per row, uint8 codes then float32 scale and bias, with
    value = scale * code + bias. Symmetric int8 maps onto it exactly (code = q + 128,
    bias = -128 * scale), so the kernel returns what q * scale gives."""
    rows = q.shape[0]
    scale = (scale if scale.numel() == rows else scale.expand(rows)).float().reshape(rows, 1).contiguous()
    codes = (q.to(torch.int16) + 128).to(torch.uint8)
    return torch.cat([codes, scale.view(torch.uint8), (-128.0 * scale).contiguous().view(torch.uint8)], dim=1).contiguous()


class Int8Embedding(nn.Module):
    """Weight-only int8 lookups on PyTorch's fused byte-rowwise embedding kernel
    (quantized::embedding_bag_byte_rowwise_offsets): as fast as an fp32 nn.Embedding, where
    gathering int8 rows and scaling them in Python measured 2.5-3x slower."""

    MODE = 0  # one ID per row: a bag of one, summed

    def __init__(self, q: torch.Tensor, scale: torch.Tensor):
        super().__init__()
        self.num_embeddings, self.embedding_dim = q.shape
        self.packed = _pack_rows(q, scale)

    def _lookup(self, values: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.embedding_bag_byte_rowwise_offsets(self.packed, values.contiguous(), offsets.contiguous(), False,
                                                                      self.MODE, False, None, None, False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # shape[0], not len(): a trace (models/inference.py) records it as the input's size, len() as a constant
        return self._lookup(ids, torch.arange(ids.shape[0], dtype=ids.dtype, device=ids.device))


class Int8EmbeddingBag(Int8Embedding):
    """Mean-pooled bags (the only mode FieldEmbeddings uses) over int8 rows: the kernel sums
    (its mean mode measured wrong results in torch 2.13), then each bag is divided by its size."""

    def forward(self, values: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        offsets = offsets.to(values.dtype)
        end = torch.full((1,), values.shape[0], dtype=offsets.dtype, device=offsets.device)  # traced as a size, as above
        sizes = torch.diff(offsets, append=end)
        return self._lookup(values, offsets) / sizes.clamp(min=1).unsqueeze(1).to(torch.float32)


class Int8Linear(nn.Module):
    """y = x W^T + b on PyTorch's dynamic int8 kernel (fbgemm on x86, qnnpack on ARM): W int8 per
    output channel, x quantized per call to 8 bits (asymmetric, from its min and max).

    torch.ao's DynamicLinear calls the kernel with reduce_range=True, i.e. 7-bit activations,
    because u8 x s8 pair sums can saturate int16 on AVX2 without VNNI. Here the weights use 7
    bits instead ([-63, 63]: 2 * 255 * 63 < 32767, so no saturation on any CPU) and the
    activations keep all 8: on a small DeepFM that cut the AUC loss of the layer from 0.0028 to
    0.0007 (measured; activations carry the outliers, weights are per-channel scaled)."""

    LIMIT = 63

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                 lo: torch.Tensor | None = None, hi: torch.Tensor | None = None):
        super().__init__()
        self.in_features, self.out_features = q.shape[1], q.shape[0]
        with warnings.catch_warnings():  # torch warns that quantized tensors will move to torchao (see above)
            warnings.simplefilter("ignore")
            qweight = torch.quantize_per_channel(q.float() * scale.unsqueeze(1), scale.double(),
                                                 torch.zeros_like(scale, dtype=torch.long), 0, torch.qint8)
            self.packed = torch.ops.quantized.linear_prepack(qweight, None if bias is None else bias.float())
        # plain floats: torch.clamp with 0-d tensor bounds measured 6x slower than with numbers (109 vs 17 us at 256 x 832)
        self.lo = None if lo is None else float(lo.min())
        self.hi = None if hi is None else float(hi.max())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        if self.lo is not None:  # see input_bounds: one row's huge value cannot flatten its batch's scores
            x = torch.clamp(x, self.lo, self.hi)
        return torch.ops.quantized.linear_dynamic(x.contiguous(), self.packed, reduce_range=False)


class InputRanges:
    """Records the per-column range of the inputs of each linear layer `quantize` turns into an
    Int8Linear, while the fp32 model scores calibration rows (the gate's validation split).

    Why: the int8 kernel quantizes its input with one range per call, and serving scores many
    clients' requests in one call. One row with a huge value (a price of 1e6) stretched that
    range until every other row of the batch rounded to the same codes and got the same score.
    Each Int8Linear clamps its input to the recorded range of the whole layer input (one range:
    the kernel's is one range per call too; per column, a column constant in the calibration
    rows, a rare flag, was pinned to that constant) widened by MARGIN of its width on each side,
    so an outlier can widen a batch's range at most 1 + 2 * MARGIN times the calibration range;
    values inside it are scored as before. (Dividing each row by its own
    magnitude instead measured 1.4x slower at 32 and 256 rows: three more kernels per layer.)
    A layer's input is the same with batch norm folded into it, so the unfolded model records it."""

    MARGIN = 0.5

    def __init__(self, model: nn.Module):
        self.lo: dict[str, torch.Tensor] = {}
        self.hi: dict[str, torch.Tensor] = {}
        self.handles = [module.register_forward_pre_hook(self._hook(name)) for name, module in model.named_modules()
                        if isinstance(module, nn.Linear) and module.weight.numel() >= MIN_INT8_WEIGHTS]

    def _hook(self, name: str):
        def record(module, args):
            x = args[0].detach().float().reshape(-1, module.in_features)
            if x.shape[0]:
                lo, hi = x.amin(dim=0), x.amax(dim=0)
                self.lo[name] = torch.minimum(self.lo[name], lo) if name in self.lo else lo
                self.hi[name] = torch.maximum(self.hi[name], hi) if name in self.hi else hi
        return record

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()

    def bounds(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, (low, high) as 0-d tensors: the range over all its input columns, widened."""
        out = {}
        for name, lo in self.lo.items():
            low, high = lo.min(), self.hi[name].max()
            pad = (high - low) * self.MARGIN
            out[name] = (low - pad, high + pad)
        return out


def fold_batch_norms(model: nn.Module) -> list[str]:
    """Fold every eval-mode BatchNorm1d that follows a Linear inside a Sequential into that
    Linear (one affine map instead of two) and replace it with Identity; returns their names."""
    folded = []
    for name, seq in model.named_modules():
        if not isinstance(seq, nn.Sequential):
            continue
        for i in range(1, len(seq)):
            lin, bn = seq[i - 1], seq[i]
            if isinstance(lin, nn.Linear) and isinstance(bn, nn.BatchNorm1d) and bn.track_running_stats:
                with torch.no_grad():
                    gamma = (bn.weight if bn.affine else torch.ones_like(bn.running_var)) / torch.sqrt(bn.running_var + bn.eps)
                    beta = bn.bias if bn.affine else torch.zeros_like(bn.running_mean)
                    bias = lin.bias if lin.bias is not None else torch.zeros_like(bn.running_mean)
                    lin.weight.mul_(gamma.unsqueeze(1))
                    lin.bias = nn.Parameter((bias - bn.running_mean) * gamma + beta)
                seq[i] = nn.Identity()
                folded.append(f"{name}.{i}" if name else str(i))
    return folded


def quantize(model: nn.Module, bounds: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """The int8 state dict and the plan (which modules became what) of an fp32 model in eval mode.
    `bounds`: InputRanges.bounds() of calibration rows, kept as each int8 layer's input clamp."""
    model = model.eval()
    plan = {"folded_batch_norm": fold_batch_norms(model), "linear": [], "embedding": [], "bag": []}
    state = {}
    replaced = set()
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and module.weight.numel() >= MIN_INT8_WEIGHTS:
            q, scale = quantize_rows(module.weight, limit=Int8Linear.LIMIT)
            state.update({f"{name}.q": q, f"{name}.scale": scale})
            if module.bias is not None:
                state[f"{name}.bias"] = module.bias.detach().float().clone()
            if bounds and name in bounds:
                state[f"{name}.lo"], state[f"{name}.hi"] = (b.detach().float().clone() for b in bounds[name])
            plan["linear"].append(name)
        elif isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.embedding_dim >= MIN_INT8_EMBEDDING_DIM:
            # One scale per row at every width: tables below dim 8 had one per table, which saved 4 bytes per
            # row on disk only (the loaded rows carry a scale each anyway) and rounded a tail ID's small
            # row to the frequent IDs' step (dim 4: 127 of 990 rows all zeros, DeepFM off by 0.07)
            q, scale = quantize_rows(module.weight)
            state.update({f"{name}.q": q, f"{name}.scale": scale})
            plan["bag" if isinstance(module, nn.EmbeddingBag) else "embedding"].append(name)
        else:
            continue
        replaced.add(name)
    for key, value in model.state_dict().items():
        owner = key.rsplit(".", 1)[0]
        if owner not in replaced:
            state[key] = value.detach().clone()
    return state, plan


def build(model: nn.Module, state: dict[str, torch.Tensor], plan: dict) -> nn.Module:
    """Turn a freshly built fp32 model of the same architecture into the int8 one."""
    for name in plan["folded_batch_norm"]:
        _set(model, name, nn.Identity())
    for kind, cls in (("embedding", Int8Embedding), ("bag", Int8EmbeddingBag)):
        for name in plan[kind]:
            _set(model, name, cls(state[f"{name}.q"], state[f"{name}.scale"]))

    swapped = [*plan["linear"], *plan["embedding"], *plan["bag"]]

    def in_swapped(key: str) -> bool:
        return any(key.startswith(name + ".") for name in swapped)

    # Everything else loads as usual; the swapped modules were built from their own tensors.
    missing, unexpected = model.load_state_dict({k: v for k, v in state.items() if not in_swapped(k)}, strict=False)
    missing = [k for k in missing if not in_swapped(k)]
    if missing or unexpected:
        raise ValueError(f"int8 checkpoint does not fit its architecture: missing {missing[:5]}, unexpected {unexpected[:5]}")
    for name in plan["linear"]:
        _set(model, name, Int8Linear(state[f"{name}.q"], state[f"{name}.scale"], state.get(f"{name}.bias"),
                                     state.get(f"{name}.lo"), state.get(f"{name}.hi")))
    return model.eval()


def _set(model: nn.Module, dotted: str, module: nn.Module) -> None:
    parent, _, leaf = dotted.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, module)
