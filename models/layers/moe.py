"""A mixture-of-experts MLP in the selective-batching style.

One step's tokens of every request arrive flat, [T, hidden]. The router scores every token against
every expert in float32; each token keeps its top-k experts and their routing weights. The T x k
(token, expert) pairs are then sorted by expert, so each chosen expert's weights run ONCE per step,
over all the tokens (of whatever requests) that chose it, and the results are added back into their
tokens' rows, weighted (index_add). An expert no token chose is never read: a decode step of one
request reads only its k experts' weights per layer.

Every expert is a gate/up + down pair of the same linear layers the dense MLP uses, so block-quantized
weights stay packed per expert (a GGUF file's 3-D expert stacks are cut into one packed weight per
expert), and tensor parallelism shards every expert the way it shards a dense MLP: each rank holds a
slice of EVERY expert's intermediate columns (gate/up column-parallel, down row-parallel), and one
all-reduce sums the partial outputs of all experts (and the shared expert) at the end. Why a slice of
every expert rather than whole experts per rank: the router is replicated and sees the same
(all-reduced) input on every rank, so every rank routes identically and does an equal share of every
chosen expert's work whatever the routing; whole experts per rank would leave a rank idle whenever no
token picks its experts (a decode step picks only k of them) and need an all-to-all of the tokens.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import cache
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from models.errors import ModelLoadError
from models.kernels import cpu as cpu_kernels
from models.layers.activation import SiluAndMul
from models.layers.attention import triton_available
from models.layers.linear import (
    MergedColumnParallelLinear,
    RowParallelLinear,
    check_shape,
)
from models.layers.native_weights import MoELayer, QWeight, is_f32, qweight
from models.layers.packed_weight import QuantizedBlocks
from models.layers.parallel import TPContext


@dataclass(frozen=True)
class Routing:
    """How a token's experts and their weights come from its router logits.

    softmax_first: softmax over all experts, then the top k of those probabilities (Qwen3-MoE, OLMoE,
        and Mixtral as transformers 5 writes it); with `normalize` the k are divided by their sum.
    otherwise: the top k logits, then a softmax over those k (Mixtral's original formulation, equal to
        softmax-first with normalize)."""

    num_experts: int
    top_k: int
    normalize: bool  # norm_topk_prob
    softmax_first: bool = True

    def __post_init__(self) -> None:
        if not 0 < self.top_k <= self.num_experts:
            raise ModelLoadError(
                f"mixture of experts: {self.top_k} experts per token out of {self.num_experts} is not a "
                "routing this server runs"
            )

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 logits [T, E] -> (weights [T, k] float32, experts [T, k] int64). On a CPU, the native
        routing (moe.c), the one the native expert call runs: a token takes the same experts whichever
        of the two ran its step."""
        if is_f32(logits) and cpu_kernels.available():
            return cpu_kernels.moe_route(logits, self.top_k, self.normalize, self.softmax_first)
        if self.softmax_first:
            probs = torch.softmax(logits, dim=-1)
            weights, experts = torch.topk(probs, self.top_k, dim=-1)
            if self.normalize:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            return weights, experts
        top, experts = torch.topk(logits, self.top_k, dim=-1)
        return torch.softmax(top, dim=-1), experts


class Router(nn.Module):
    """The replicated [experts, hidden] gate; its logits are computed in float32 whatever the model
    dtype (routing decisions flip on small differences). A block-quantized router (a GGUF
    `ffn_gate_inp` in a K-quant) is dequantized: it is small, and stays off the int8 kernels."""

    def __init__(self, hidden: int, num_experts: int, dtype: torch.dtype) -> None:
        super().__init__()
        # Held in float32, the dtype its logits are computed in, with the model dtype's values (the
        # loader rounds through it): no conversion of the weight in every step.
        self.dtype = dtype
        self.weight = nn.Parameter(torch.empty(num_experts, hidden, dtype=torch.float32), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor | QuantizedBlocks, shard: object
    ) -> None:
        if isinstance(loaded, QuantizedBlocks):
            loaded = loaded.dequantize()
        check_shape(loaded, param.shape)
        param.data.copy_(loaded.to(self.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """float32 logits [T, E]; on a CPU the native router's (one fixed-order dot product per logit,
        as the native expert call computes them), else torch's."""
        xf = x.float()
        if cpu_kernels.fits_rowwise(xf, xf.shape[-1]) and xf.dim() == 2:
            return cpu_kernels.router_logits(xf, self.weight)
        return F.linear(xf, self.weight)


class Expert(nn.Module):
    """One expert's gated MLP, down(silu(gate) * up); its output is this rank's partial sum (the
    all-reduce is the whole layer's, once)."""

    def __init__(self, hidden: int, inter: int, dtype: torch.dtype, tp: TPContext) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [inter, inter], False, dtype, tp)
        self.down_proj = RowParallelLinear(inter, hidden, False, dtype, tp)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.matmul(self.act(self.gate_up_proj(x)))


class SharedExpertGate(Router):
    """sigmoid(x . w): how much of the shared expert a token takes (Qwen2-MoE's `shared_expert_gate`,
    [1, hidden]); replicated, float32 like the router."""

    def __init__(self, hidden: int, dtype: torch.dtype) -> None:
        super().__init__(hidden, 1, dtype)

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor | QuantizedBlocks, shard: object
    ) -> None:
        # A GGUF file stores it as a vector (ffn_gate_inp_shexp [hidden]).
        if isinstance(loaded, torch.Tensor) and loaded.dim() == 1:
            loaded = loaded.unsqueeze(0)
        super().weight_loader(param, loaded, shard)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(super().forward(x))


@dataclass(frozen=True)
class MoESizes:
    hidden: int
    expert_inter: int  # each routed expert's intermediate size
    shared_inter: int = 0  # the shared expert's (0: none)
    shared_gate: bool = False  # a sigmoid gate on the shared expert


def _native_pair(expert: Expert) -> tuple[QWeight, QWeight] | None:
    """An expert's packed gate_up and down as orca_gated_mlp takes them (no bias, gate_up [2I, hidden]
    over down [hidden, I], I a multiple of 8), or None."""
    g, d = qweight(expert.gate_up_proj), qweight(expert.down_proj)
    if g is None or d is None or g.bias or d.bias or d.K % 8 or (g.N, g.K) != (2 * d.K, d.N):
        return None
    return g, d


class NativeExperts:
    """The router, routing, every expert's packed gate_up and down, and the shared expert and its
    gate if any, described to moe.c once (`struct`), so a step's whole MoE MLP runs in one call
    (orca_moe: the native router and routing the module also uses, then the same kernels in the same
    order as the module's loop over the chosen experts, bit-identical to it, without the Python and
    torch calls around them; the shared expert's sigmoid gate is the C one, so that part matches the
    module's torch one to rounding). The fused decode layers (decode_layers.c) call the same function
    through `struct`, so a token's output does not depend on which of the two ran its step."""

    def __init__(
        self,
        router: Router,
        routing: Routing,
        gate_up: list[QWeight],
        down: list[QWeight],
        shared: tuple[QWeight, QWeight, SharedExpertGate | None] | None = None,
    ) -> None:
        n = routing.num_experts
        # Kept here: the struct holds their addresses.
        self._gate_up, self._down = (QWeight * n)(*gate_up), (QWeight * n)(*down)
        self._router = router.weight
        self.struct = MoELayer(
            router=router.weight.data_ptr(),
            gate_up=ctypes.addressof(self._gate_up),
            down=ctypes.addressof(self._down),
            num_experts=n,
            top_k=routing.top_k,
            hidden=down[0].N,
            inter=down[0].K,
            normalize=int(routing.normalize),
            softmax_first=int(routing.softmax_first),
        )
        if shared is not None:
            self._shared = shared  # kept: the struct holds their addresses
            shared_gate_up, shared_down, gate = shared
            self.struct.shared_gate_up = ctypes.addressof(shared_gate_up)
            self.struct.shared_down = ctypes.addressof(shared_down)
            self.struct.shared_inter = shared_down.K
            self.struct.shared_gate = gate.weight.data_ptr() if gate is not None else None
        self._lib = cpu_kernels.kernels().lib  # type: ignore[union-attr]

    @classmethod
    def build(
        cls,
        router: Router,
        routing: Routing,
        experts: nn.ModuleList,
        shared_expert: Expert | None = None,
        shared_gate: SharedExpertGate | None = None,
    ) -> NativeExperts | None:
        """The description, or None where the experts (and the shared one) are not all packed for the
        native kernels."""
        if not cpu_kernels.available() or not is_f32(router.weight):
            return None
        pairs = [_native_pair(e) for e in experts]
        if any(p is None for p in pairs):
            return None
        gate_up, down = [p[0] for p in pairs], [p[1] for p in pairs]
        hidden, inter = down[0].N, down[0].K
        if hidden % 8 or any((d.N, d.K) != (hidden, inter) for d in down):
            return None
        shared = None
        if shared_expert is not None:
            pair = _native_pair(shared_expert)
            if pair is None or pair[1].N != hidden:
                return None
            if shared_gate is not None and not is_f32(shared_gate.weight):
                return None
            shared = (*pair, shared_gate)
        return cls(router, routing, gate_up, down, shared)

    def run(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """out [T, hidden] += the MoE MLP of x [T, hidden] (both float32, contiguous)."""
        with cpu_kernels.labelled("moe"):
            rc = self._lib.orca_moe(ctypes.addressof(self.struct), x.data_ptr(), x.shape[0], out.data_ptr())
        if rc:
            raise RuntimeError(f"native experts failed (rc {rc}) on {x.shape[0]} tokens")


@cache
def fused_experts_run_on(device: torch.device) -> bool:
    """Whether the routed experts run as two Triton launches (triton_moe.py) on this device: on a GPU
    with Triton (compiled), never on a CPU outside the tests (the interpreter is for CI only)."""
    return device.type == "cuda" and triton_available(device)


class StackedExperts:
    """Every expert's gate_up and down weights as two [E, N, K] tensors for the fused kernels; each
    expert's own parameter becomes a view of its slice, so the weights are held once and the module
    loop still reads them."""

    def __init__(self, experts: nn.ModuleList) -> None:
        self.gate_up = self._stack([e.gate_up_proj for e in experts])  # [E, 2I, hidden]
        self.down = self._stack([e.down_proj for e in experts])  # [E, hidden, I]

    @staticmethod
    def _stack(layers: list[nn.Module]) -> torch.Tensor:
        # Built on a step's first use, inside the runner's inference mode: a normal tensor all the same,
        # or the parameters (views of it) could not be loaded into again outside that mode.
        with torch.inference_mode(False):
            stacked = torch.stack([layer.weight.data for layer in layers])
        for i, layer in enumerate(layers):
            layer.weight.data = stacked[i]
        return stacked

    def current(self, experts: nn.ModuleList) -> bool:
        """Still the experts' storage (not replaced since, by a reload or a move to another device)."""
        first = experts[0]
        return (
            first.gate_up_proj.weight.data_ptr() == self.gate_up.data_ptr()
            and first.down_proj.weight.data_ptr() == self.down.data_ptr()
        )


class SparseMoE(nn.Module):
    """The MoE MLP over flat tokens [T, hidden] -> [T, hidden]. Parameter names follow the HF
    checkpoints': `gate` (the router), `experts.<e>.{gate_up_proj,down_proj}`, `shared_expert`,
    `shared_expert_gate`.

    Three ways to run the routed experts, by device: the native call (CPU, packed experts), the fused
    Triton kernels (GPU), the module loop over the chosen experts (anything else)."""

    def __init__(self, sizes: MoESizes, routing: Routing, dtype: torch.dtype, tp: TPContext) -> None:
        super().__init__()
        self.routing = routing
        self.tp = tp
        self.gate = Router(sizes.hidden, routing.num_experts, dtype)
        self.experts = nn.ModuleList(
            Expert(sizes.hidden, sizes.expert_inter, dtype, tp) for _ in range(routing.num_experts)
        )
        self.shared_expert = (
            Expert(sizes.hidden, sizes.shared_inter, dtype, tp) if sizes.shared_inter else None
        )
        self.shared_expert_gate = SharedExpertGate(sizes.hidden, dtype) if sizes.shared_gate else None
        # The experts described to the native kernels, once they are packed (native_experts).
        self._native: tuple[object, NativeExperts | None] | None = None
        self._stacked: StackedExperts | None = None  # for the fused kernels (stacked_experts)

    def native_experts(self) -> NativeExperts | None:
        """The native description of the experts as they are now packed (rebuilt if they were packed
        again), or None where the module loop runs them."""
        packed = self.experts[0].gate_up_proj.packed
        if packed is None:
            return None
        # Keyed on where the tiles are, not on the object: a packed weight moved in place (to huge
        # pages) keeps its identity and changes its addresses.
        where = packed.kernel_args
        if self._native is None or self._native[0] != where:
            self._native = (
                where,
                NativeExperts.build(
                    self.gate, self.routing, self.experts, self.shared_expert, self.shared_expert_gate
                ),
            )
        return self._native[1]

    def native_struct(self) -> MoELayer | None:
        """The whole layer's C description for the fused decode layers (native_decode.NativeMLP), or
        None where the native kernels do not take its experts."""
        native = self.native_experts()
        return native.struct if native is not None else None

    def stacked_experts(self) -> StackedExperts | None:
        """The experts' weights stacked for the fused kernels (built on first use, after loading), or
        None where some expert's weight is packed for the CPU kernels."""
        if self._stacked is not None and self._stacked.current(self.experts):
            return self._stacked  # every step but the first: no walk over the experts
        if any(e.gate_up_proj.weight is None or e.down_proj.weight is None for e in self.experts):
            return None
        self._stacked = StackedExperts(self.experts)
        return self._stacked

    def capture_blocker(self, device: torch.device) -> str | None:
        """Why a CUDA graph cannot capture this layer's steps on `device` (None: it can). The module
        loop reads the experts' token counts back to the host, which a capture cannot do and a replay
        would freeze; the fused kernels read nothing back."""
        if fused_experts_run_on(device):
            return None
        return "its experts run one matmul pair per chosen expert (the fused kernels need Triton)"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        native = self.native_experts() if is_f32(x) else None
        if native is not None:
            out = torch.zeros_like(x)
            native.run(x, out)  # the routed experts and the shared one
            return self.tp.all_reduce(out)
        weights, chosen = self.routing.route(self.gate(x))  # [T, k] each
        stacked = self.stacked_experts() if fused_experts_run_on(x.device) and x.shape[0] else None
        if stacked is not None:
            from models.layers.triton_moe import fused_experts

            out = fused_experts(x, stacked.gate_up, stacked.down, weights, chosen, self.experts[0].act)
        else:
            out = torch.zeros_like(x)
            self._loop_experts(x, weights, chosen, out)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = shared * self.shared_expert_gate(x).to(x.dtype)
            out += shared
        return self.tp.all_reduce(out)

    def _loop_experts(
        self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor, out: torch.Tensor
    ) -> None:
        """out += each chosen expert's weighted output, one expert at a time over its tokens."""
        k = self.routing.top_k
        flat = chosen.reshape(-1)
        # The (token, expert) pairs grouped by expert, token order kept within each group.
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.routing.num_experts).tolist()
        token_of = order // k
        pair_weight = weights.reshape(-1)[order].to(x.dtype)
        start = 0
        for expert, n in zip(self.experts, counts, strict=True):
            if n:
                rows = token_of[start : start + n]
                y = expert(x.index_select(0, rows))
                out.index_add_(0, rows, y * pair_weight[start : start + n].unsqueeze(1))
                start += n


# Routing settings of other MoE configs that change which experts a token takes or how their outputs
# are weighed, with the value under which this layer's routing is what they describe. A config that
# states another value is refused rather than run with the wrong routing.
ROUTING_DEFAULTS: dict[str, tuple[Any, ...]] = {
    "scoring_func": ("softmax",),
    "topk_method": ("greedy",),
    "n_group": (None, 1),
    "topk_group": (None, 1),
    "routed_scaling_factor": (None, 1, 1.0),
    "n_shared_experts": (None, 0),
    "router_bias": (None, False),
    "moe_router_bias": (None, False),
}


def check_routing(config: Any, family: str) -> None:
    """A ModelLoadError naming the first setting of `config` this server's routing does not run."""
    for key, accepted in ROUTING_DEFAULTS.items():
        if hasattr(config, key) and getattr(config, key) not in accepted:
            raise ModelLoadError(
                f"unsupported mixture-of-experts routing for {family}: {key}={getattr(config, key)!r} "
                f"(this server routes by softmax, then the top k, only: {key} must be "
                f"{' or '.join(repr(a) for a in accepted)})"
            )
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise ModelLoadError(f"unsupported expert activation hidden_act={act!r} for {family} (only 'silu')")
