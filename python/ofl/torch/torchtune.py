"""torchtune's activation offloading names over ofl
(torchtune/training/_activation_offloading.py): a recipe changes only its
import,

    from ofl.torch.torchtune import get_act_offloading_ctx_manager

and keeps ``with get_act_offloading_ctx_manager(model, cfg.enable_activation_
offloading):`` around its forward.

* ``OffloadActivations(use_pin_memory=True, use_streams=None,
  max_fwd_stash_size=5, min_offload_size=1024)``: ofl's class
  (ofl.torch.offload), same positional order; ``model=`` (keyword) names
  the model whose output head stays.
* ``NoOpManager()``: saved-tensor hooks that keep every tensor where it is
  (the innermost hooks win), as torchtune's.
* ``get_act_offloading_ctx_manager(model, enable_activation_offloading)``:
  ``OffloadActivations(model=model)`` (the output head exempt by torchtune's
  rule: ``model.output``, its ``.linear`` when tied; ofl also takes
  ``model.lm_head``) or ``contextlib.nullcontext()``. Unlike torchtune,
  nothing is registered on the model: the head's hooks live only while the
  context is entered. A model with a ``decoder`` and no ``output``
  (torchtune's multimodal models) is refused as torchtune refuses it.
"""
import contextlib

from torch.autograd.graph import saved_tensors_hooks

from .offload import OffloadActivations

__all__ = ["OffloadActivations", "NoOpManager", "get_act_offloading_ctx_manager"]


class NoOpManager(saved_tensors_hooks):
    """Saved-tensor hooks that keep every tensor where it is: a region under
    it opts out of an enclosing offloading context."""

    def __init__(self):
        def noop(tensor):
            return tensor

        super().__init__(noop, noop)


def get_act_offloading_ctx_manager(model, enable_activation_offloading):
    """torchtune's: the offloading context for ``model`` (its output head
    kept), or a null context when ``enable_activation_offloading`` is false."""
    if not enable_activation_offloading:
        return contextlib.nullcontext()
    if not hasattr(model, "output") and hasattr(model, "decoder"):
        raise NotImplementedError(
            "Multimodal model does not support activation offloading yet (torchtune's "
            "get_act_offloading_ctx_manager refuses it too). Please set "
            "enable_activation_offloading=False, or use ofl.torch.OffloadActivations(model=...) "
            "directly")
    return OffloadActivations(model=model, warn_if_no_head=True)
