"""Axolotl's activation offloading names over ofl (Axolotl's trainer mixin
``get_lora_act_offloading_ctx_manager``, the trl function it imports for
full fine-tuning, and Disco, its ``gradient_checkpointing: offload_disk``
path). A training script changes only its import:

    from ofl.torch.axolotl import get_lora_act_offloading_ctx_manager
    from ofl.torch.axolotl import get_act_offloading_ctx_manager   # trl's
    transformers.modeling_utils.checkpoint = \\
        ofl.torch.axolotl.hf_grad_checkpoint_disk_offload_wrapper  # offload_disk

* ``get_lora_act_offloading_ctx_manager(model, use_pin_memory=True,
  use_streams=True, min_offload_size=1024, max_fwd_stash_size=5,
  warn_if_no_head=True)``: every saved activation but those of the last
  output Linear is offloaded. The head is found as Axolotl finds it: the
  model is unwrapped (``.module``, then a PEFT model's ``.base_model``),
  then ``output`` (or ``output.linear``), ``lm_head``, ``decoder.output`` or
  ``decoder.lm_head``, ``final_layer_norm`` or ``ln_f``, ``head``. As in
  Axolotl, Liger modules and every module inside a
  ``_checkpoint_wrapped_module`` keep their activations too. Unlike Axolotl,
  nothing stays registered on the model: the hooks live while the context
  is entered.
* ``get_act_offloading_ctx_manager(model, use_pin_memory=True,
  use_streams=True, min_offload_size=1024, max_fwd_stash_size=5,
  warn_if_no_head=True)``: trl's (Axolotl calls it for models without
  adapters): the same class with the head rule of
  ofl.torch.OffloadActivations (``output``, ``output.linear``, ``lm_head``).
* ``Disco`` and ``hf_grad_checkpoint_disk_offload_wrapper``: see
  ofl.torch.disk.
"""
import warnings

import torch

from .disk import Disco, hf_grad_checkpoint_disk_offload_wrapper
from .offload import OffloadActivations

__all__ = ["get_lora_act_offloading_ctx_manager", "get_act_offloading_ctx_manager", "Disco",
           "hf_grad_checkpoint_disk_offload_wrapper", "find_axolotl_head"]


def _module(m):
    return m if isinstance(m, torch.nn.Module) else None


def _unwrap(model):
    m = model
    if hasattr(m, "module"):
        m = m.module
    if hasattr(m, "base_model") and hasattr(m, "peft_config"):
        m = m.base_model
    return m


def find_axolotl_head(model):
    """The module whose activations stay, by Axolotl's rule; None if none."""
    m = _unwrap(model)
    if hasattr(m, "output"):
        out = m.output
        return _module(out) or _module(getattr(out, "linear", None))
    if hasattr(m, "lm_head"):
        return _module(m.lm_head)
    if hasattr(m, "decoder"):
        d = m.decoder
        if hasattr(d, "output"):
            return _module(d.output)
        if hasattr(d, "lm_head"):
            return _module(d.lm_head)
        return None
    if hasattr(m, "final_layer_norm") or hasattr(m, "ln_f"):
        return _module(getattr(m, "final_layer_norm", None) or m.ln_f)
    return _module(getattr(m, "head", None))


def _kept_modules(model):
    """Axolotl's other exemptions: Liger modules, and the modules inside an
    activation-checkpoint wrapper (LoRA training)."""
    kept = []
    for name, mod in _unwrap(model).named_modules():
        if "liger" in name.lower():
            kept.append(mod)
        if name.endswith("._checkpoint_wrapped_module"):
            kept.extend(mod.modules())
    return kept


class _AxolotlOffload(OffloadActivations):
    """OffloadActivations whose exempt modules are the head and ``kept``."""

    def __init__(self, model, head, kept, **kw):
        super().__init__(model=model, warn_if_no_head=False, **kw)
        self._head = head
        self._kept = [m for m in kept if m is not head]

    def __enter__(self):
        outer = self._depth == 0
        r = super().__enter__()
        if outer and self._depth == 1 and getattr(self, "_grad", False):
            for m in self._kept:
                self._handles.append(m.register_forward_pre_hook(self._head_pre))
                self._handles.append(m.register_forward_hook(self._head_post, always_call=True))
        return r


def _no_head_warning():
    warnings.warn(
        "During activation offloading, no output head was detected. If your model has an output "
        "head, it will be offloaded. This usually greatly slows training, given the large "
        "vocabulary size. To change this behavior, set your output head as model.output and make "
        "it an nn.Module. You can disable this warning by passing `warn_if_no_head=False`.",
        stacklevel=3)


def get_lora_act_offloading_ctx_manager(model, use_pin_memory=True, use_streams=True,
                                        min_offload_size=1024, max_fwd_stash_size=5,
                                        warn_if_no_head=True):
    """Axolotl's: all but the last output Linear in every step is offloaded
    (through ofl's manager)."""
    head = find_axolotl_head(model)
    if head is None and warn_if_no_head:
        _no_head_warning()
    return _AxolotlOffload(model, head, _kept_modules(model), use_pin_memory=use_pin_memory,
                           use_streams=use_streams, max_fwd_stash_size=max_fwd_stash_size,
                           min_offload_size=min_offload_size)


def get_act_offloading_ctx_manager(model, use_pin_memory=True, use_streams=True,
                                   min_offload_size=1024, max_fwd_stash_size=5,
                                   warn_if_no_head=True):
    """trl's (trl.models.activation_offloading), which Axolotl uses for full
    fine-tuning: OffloadActivations with the model's head kept."""
    return OffloadActivations(use_pin_memory, use_streams, max_fwd_stash_size, min_offload_size,
                              model=model, warn_if_no_head=warn_if_no_head)
