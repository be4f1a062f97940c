"""Linear layers whose weights and matmul belong to a pluggable method (vLLM's `quant_method` pattern).

A model declares each Linear by its shapes only: input size, output rows per shard, bias, and whether the
weight is the embedding's (a tied lm_head). How the layer keeps its weights and computes y = x W^T + b is
its `LinearMethod`'s business: the dense CPU method (folio.models.dense_linear) prepacks bf16 weights for
oneDNN; a quantised method would create packed integer weights and scales; a tensor-parallel one, a slice.

Methods are bound after the model is built, by `bind_linear_methods(model, methods)`, which walks the model
and lets each layer's method create its parameters. So swapping the method needs no change to a model file,
and a chooser given the layer's name (its prefix, e.g. "layers.3.mlp.down_proj") can pick a method per
layer, as a quantisation config does when it keeps the lm_head dense.

A fused layer (q/k/v, gate/up) stacks its shards' rows in declaration order; a parameter laid out by
output row is loaded shard by shard into those rows (`Linear.load_rows`).

Tensor parallelism (folio.distributed): a model built for one rank's slice declares its layers at the rank's
sizes and marks them `parallel`. A column-parallel layer (q/k/v, gate/up) holds the rank's rows of each shard,
a row-parallel one (o_proj, down_proj) the rank's columns, and sums the ranks' partial products. The slicing
wraps the parameters' weight loaders after the method created them, so every method that loads plain
checkpoint tensors (the dense one, those that quantise as they load) gets its slice without knowing of ranks. The
lm_head splits by vocabulary, its rows: folio.models.vocab_parallel.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable, Iterator, Mapping, Optional, Union

import torch
from torch import nn

from folio.distributed.parallel_state import tensor_parallel_group
from folio.models.hot_path import HotPathModule
from folio.models.layers import Embedding, silu_and_mul
from folio.models.weight_loader import (ShardId, copy_checked, default_weight_loader, set_weight_loader, uninitialized,
                                        weight_loader_of)
from folio.sample.sampling_ops import argmax_rows


class LinearMethod(ABC):
    """How Linear layers keep their weights and compute. One object may serve many layers: it keeps per-layer
    state on the layer, as attributes it creates in `create_weights`.

    plain_weights: whether a loaded layer's `weight` is the plain float [output_size, input_size] matrix
    until `process_weights_after_loading`, so that a module may take it over (an MoE layer stacks its
    experts': folio.models.fused_moe). In the layer's params_dtype, except that a float32 layer's may be
    held in bf16 as a bf16 checkpoint stores it (the dense method: folio.models.bf16_valued), the same values.
    Quantised methods keep packed integers: False."""

    plain_weights = False

    @abstractmethod
    def create_weights(self, layer: "Linear") -> None:
        """Register the layer's parameters (and any per-layer state) on it, each with a weight loader that
        places checkpoint tensors into it (`Linear.row_parameter` makes the usual ones). A tied layer
        already has its `weight`: the embedding's parameter, loaded as the embedding."""

    def process_weights_after_loading(self, layer: "Linear") -> None:
        """Turn the loaded weights into the form `apply` wants (a packed layout, say). Default: nothing."""

    @abstractmethod
    def apply(self, layer: "Linear", x: torch.Tensor) -> torch.Tensor:
        """y = x W^T + b for x [..., input_size]; on the hot path, once per layer per step."""

    def apply_silu_and_mul(self, layer: "Linear", x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of a layer made with silu_and_mul=True, [..., output_size / 2]: folio.models.layers.
        silu_and_mul of apply's product. A method may fuse the op into its matmul (the int8 one on AMX-INT8, the
        dense bf16 one on AMX tiles: weights in folio.models.gated_layout), which then writes half the product and
        skips the op's pass."""
        return silu_and_mul(self.apply(layer, x))

    def weight_rows(self, layer: "Linear") -> Optional[Callable[[torch.Tensor], torch.Tensor]]:
        """For a processed layer: a function from row indices to those rows of the weight exactly as loaded,
        where the method's own copy can give them; None (the default) where it cannot. A tied lm_head's embedding
        then looks its tokens up there and frees the table (`process_weights_after_loading`)."""
        return None

    def apply_argmax(self, layer: "Linear", x: torch.Tensor) -> torch.Tensor:
        """The index of each row's largest output, int64 [rows of x] (torch.argmax's: first maximum, first NaN):
        a greedy step's token from the lm_head. Default: the argmax of apply's product. A method may keep the
        product from ever being written (the dense one on AMX: folio.models.small_batch_gemm.linear_argmax)."""
        return argmax_rows(self.apply(layer, x.reshape(-1, x.shape[-1])))


LinearMethodChooser = Callable[[str, "Linear"], LinearMethod]
LinearMethods = Union[LinearMethod, LinearMethodChooser]


class Linear(HotPathModule):
    """y = x W^T + b, computed by the bound LinearMethod.

    output_sizes: the number of output rows, or {shard id: rows} for a fused layer whose checkpoint keeps
    its parts as separate tensors (e.g. {"q": 512, "k": 128, "v": 128}); its output is their concatenation.
    tied_to: the embedding parameter that is this layer's weight too (a tied lm_head).
    silu_and_mul: the layer is a gated MLP's gate/up, two shards of one size, gates first, and its output is
    silu(gate) * up, [..., output_size / 2] (SwiGLU): by its method's apply_silu_and_mul, which may fuse the two.
    params_dtype: the weights' dtype; by default torch's default dtype while the model is built (the
    loader builds it under the serving dtype), so weights are created directly in it.
    parallel: "column" or "row" for a layer that tensor-parallel ranks split (the sizes given are the rank's);
    whole when the process's group has one rank. shard_replicas: of a column-parallel layer, how many ranks
    share each shard's rows (KV heads fewer than ranks: each rank keeps one); 1 where not given. reduce_results:
    of a row-parallel layer, whether it sums the ranks' partial products itself; False leaves the sum to its owner,
    which makes one for several layers (a mixture of experts sums its weighted experts once, not each expert).
    """

    def __init__(self, input_size: int, output_sizes: Union[int, Mapping[ShardId, int]], bias: bool = False,
                 tied_to: Optional[nn.Parameter] = None, params_dtype: Optional[torch.dtype] = None,
                 silu_and_mul: bool = False, parallel: Optional[str] = None,
                 shard_replicas: Optional[Mapping[ShardId, int]] = None, reduce_results: bool = True) -> None:
        super().__init__()
        if parallel not in (None, "column", "row"):
            raise ValueError(f"Linear parallel must be 'column' or 'row', got {parallel!r}")
        self.tp = tensor_parallel_group()
        self.parallel = parallel if self.tp.size > 1 else None
        self.shard_replicas = dict(shard_replicas or {})
        self.reduce_results = reduce_results
        sizes = {None: output_sizes} if isinstance(output_sizes, int) else dict(output_sizes)
        if not sizes or any(size <= 0 for size in sizes.values()):
            raise ValueError(f"Linear output sizes must be positive, got {output_sizes!r}")
        if silu_and_mul and (len(sizes) != 2 or len(set(sizes.values())) != 1):
            raise ValueError(f"a silu_and_mul Linear has two shards of one size (gate, up), got {output_sizes!r}")
        self.silu_and_mul = silu_and_mul
        self.input_size = input_size
        self.shards: dict[ShardId, tuple[int, int]] = {}  # shard id -> (first row, rows)
        first = 0
        for shard_id, rows in sizes.items():
            self.shards[shard_id] = (first, rows)
            first += rows
        self.output_size = first
        self.with_bias = bias
        self.params_dtype = params_dtype or torch.get_default_dtype()
        self.tied = tied_to is not None
        if tied_to is not None:
            if tuple(tied_to.shape) != (self.output_size, input_size):
                raise ValueError(f"a tied Linear({input_size}, {self.output_size}) needs a weight of shape "
                                 f"{(self.output_size, input_size)}, got {tuple(tied_to.shape)}")
            self.weight = tied_to
            tied_to.tied_head = True  # the embedding's loader leaves the table's dtype to this layer's method
        self.method: Optional[LinearMethod] = None

    def bind(self, method: LinearMethod) -> None:
        if self.method is not None:
            raise ValueError(f"this Linear is already bound to {type(self.method).__name__}")
        method.create_weights(self)
        self.method = method
        if self.parallel is not None:
            self._load_rank_slices()
        if self.parallel == "row" and self.reduce_results:  # an instance's forward is what a call runs: whole
            # layers, and those whose owner sums, keep theirs as it is
            self.forward = self._forward_and_sum

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.silu_and_mul:
            return self.method.apply_silu_and_mul(self, x)
        return self.method.apply(self, x)

    def _forward_and_sum(self, x: torch.Tensor) -> torch.Tensor:
        """A row-parallel layer's: the sum of every rank's partial product."""
        return self.tp.all_reduce(Linear.forward(self, x))

    def _load_rank_slices(self) -> None:
        """Make each parameter's weight loader take the rank's slice of a checkpoint tensor: of a column-parallel
        layer, the rank's rows of each shard; of a row-parallel one, the rank's columns of a weight, and its bias
        on rank 0 only (zeros elsewhere), so that the sum of the partial products adds it once."""
        rank, size = self.tp.rank, self.tp.size
        for name, param in self._parameters.items():
            if param is None or (self.tied and name == "weight"):
                continue
            load = weight_loader_of(param)
            if self.parallel == "column":
                def load_slice(p: nn.Parameter, tensor: torch.Tensor, shard_id: ShardId, load=load) -> None:
                    _, rows = self.shard_extent(shard_id)
                    replicas = self.shard_replicas.get(shard_id, 1)
                    if tensor.shape[0] != rows * size // replicas:
                        raise ValueError(f"has {tensor.shape[0]} rows, expected {rows * size // replicas} ({rows} a "
                                         f"rank)")
                    load(p, tensor.narrow(0, rank // replicas * rows, rows), shard_id)

                if getattr(param, "shard_extents", None):  # a tensor of all the shards (ALL_SHARDS) is cut at
                    param.shard_extents, first = {}, 0      # their whole sizes
                    for shard_id, (_, rows) in self.shards.items():
                        whole = rows * size // self.shard_replicas.get(shard_id, 1)
                        param.shard_extents[shard_id], first = (first, whole), first + whole
            else:
                def load_slice(p: nn.Parameter, tensor: torch.Tensor, shard_id: ShardId, load=load,
                               bias: bool = name == "bias") -> None:
                    if bias:
                        load(p, tensor if rank == 0 else torch.zeros_like(tensor), shard_id)
                        return
                    columns = self.input_size
                    if tensor.shape[-1] != columns * size:
                        raise ValueError(f"has {tensor.shape[-1]} columns, expected {columns * size} ({columns} "
                                         f"a rank)")
                    load(p, tensor.narrow(-1, rank * columns, columns), shard_id)
            param.weight_loader = load_slice

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """argmax(forward(x), dim=-1) for x [rows, input_size], by the method's apply_argmax."""
        return self.method.apply_argmax(self, x)

    def row_parameter(self, *row_shape: int, dtype: Optional[torch.dtype] = None) -> nn.Parameter:
        """An uninitialised parameter with one row per output feature (a weight: row_shape (input_size,);
        a bias: (); a per-row scale...), in params_dtype unless told, loaded shard by shard into its rows."""
        param = uninitialized(self.output_size, *row_shape, dtype=dtype or self.params_dtype)
        set_weight_loader(param, self.load_rows, self.shards)
        return param

    def shard_extent(self, shard_id: ShardId) -> tuple[int, int]:
        """(first output row, rows) of a shard, for weight loaders: an unknown shard is a ValueError."""
        if shard_id not in self.shards:
            raise ValueError(f"is given as shard {shard_id!r} of a layer whose shards are {list(self.shards)}")
        return self.shards[shard_id]

    def load_rows(self, param: nn.Parameter, tensor: torch.Tensor, shard_id: ShardId) -> None:
        """Weight loader of row parameters: the shard's tensor goes into the shard's rows."""
        first, rows = self.shard_extent(shard_id)
        copy_checked(param.data.narrow(0, first, rows), tensor)


def load_rank_rows(param: nn.Parameter, replicas: int = 1) -> None:
    """Make a per-head parameter outside the Linear layers (GPT-OSS's attention sinks, OLMo 2's q/k norm weights)
    load this tensor-parallel rank's rows of the whole checkpoint tensor: its heads' rows, as a column-parallel layer
    keeps, each slice kept by `replicas` ranks (KV heads fewer than ranks); the whole tensor on one rank."""
    tp = tensor_parallel_group()
    rows = param.shape[0]
    whole, first = rows * tp.size // replicas, tp.rank // replicas * rows

    def load_rank_slice(p: nn.Parameter, tensor: torch.Tensor, shard_id: ShardId) -> None:
        if tensor.shape[0] != whole:
            raise ValueError(f"has {tensor.shape[0]} rows, expected {whole}")
        default_weight_loader(p, tensor.narrow(0, first, rows), shard_id)

    set_weight_loader(param, load_rank_slice, (None,))


def linear_layers(model: nn.Module) -> Iterator[tuple[str, Linear]]:
    return ((name, m) for name, m in model.named_modules() if isinstance(m, Linear))


def as_chooser(methods: LinearMethods) -> LinearMethodChooser:
    return (lambda name, layer: methods) if isinstance(methods, LinearMethod) else methods


def bind_linear_methods(model: nn.Module, methods: LinearMethods) -> None:
    """Bind every Linear of the model to its method, which creates the layer's parameters.

    methods: one LinearMethod for all layers, or a chooser (layer name, layer) -> LinearMethod.
    """
    choose = as_chooser(methods)
    for name, layer in linear_layers(model):
        layer.bind(choose(name, layer))


def process_weights_after_loading(model: nn.Module) -> None:
    """First the modules that process their Linear layers' weights themselves (they define
    process_weights_after_loading: MoE experts, which may stack theirs and drop the layers), while the weights
    are as loaded; then each remaining Linear's method."""
    for module in list(model.modules()):
        if not isinstance(module, Linear) and hasattr(module, "process_weights_after_loading"):
            module.process_weights_after_loading()
    for _, layer in linear_layers(model):
        layer.method.process_weights_after_loading(layer)
    share_tied_tables(model)


def share_tied_tables(model: nn.Module) -> None:
    """An embedding whose table is a tied lm_head's weight looks its tokens up in that layer's processed copy
    where the method gives its rows (LinearMethod.weight_rows), and the table is freed: a model keeps one copy of
    it, not the table and a packed copy (0.5B Qwen2: 545 MB in float32, 272 MB in bf16)."""
    embeddings = {id(module.weight): module for module in model.modules()
                  if isinstance(module, Embedding) and module.weight is not None}
    for _, layer in linear_layers(model):
        embedding = embeddings.get(id(layer.weight)) if layer.tied else None
        rows = None if embedding is None else layer.method.weight_rows(layer)
        if rows is not None:
            embedding.look_up_in(rows)
            layer.weight = None
