"""Which transformers class a config builds: one lookup for every command that builds a model.

A checkpoint's ``config.json`` names the class it was saved from in ``architectures``;
:func:`architecture_class` is the one place that turns those names into a class. Callers differ
only in what they do when no name resolves, and each fallback here is named for it:

* :func:`model_class` (``ckpt shard``): AutoModel's class for the config's type, else
  :class:`~ckpt_tools.errors.BadInput` (the config is newer than this transformers);
* :func:`build_from_config` (``ckpt estimate``): an instance, falling back to
  ``AutoModelForCausalLM`` and then to the bare ``AutoModel``, since only parameter shapes count;
* :mod:`.archcheck` asks only for the first name and words its own refusals (``Unchecked``);
  a config with no ``architectures`` is checked against :func:`class_for_type`.

transformers (and torch with it) is imported inside the functions: importing this module costs
nothing, so a command that never builds a model never pays for them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from ..errors import BadInput

if TYPE_CHECKING:
    from torch import nn


INSTALL = "pip install 'ckpt-tools[hf]'"


def require_transformers(what: str) -> None:
    """Raise BadInput (exit 3) naming the install when transformers is missing: ``what`` (a
    command, or the file it reads) needs it. Imports it (the caller is about to use it)."""
    try:
        import transformers  # noqa: F401
    except ImportError as e:
        raise BadInput(f"{what} needs transformers, which is not installed; run `{INSTALL}`") from e


def dtype_argument(dtype) -> dict:
    """The keyword ``from_pretrained``/``_from_config`` take a dtype under (as torch's dtype): ``dtype`` since
    transformers 4.56, ``torch_dtype`` before (which 5.x no longer takes)."""
    import transformers

    from ..core.dtypes import as_torch

    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    return {"dtype": as_torch(dtype)} if (major, minor) >= (4, 56) else {"torch_dtype": as_torch(dtype)}


def architecture_class(names: Iterable[Any] | None) -> type | None:
    """The first of ``names`` (a config's ``architectures``) that transformers ships as a model
    class, i.e. a ``PreTrainedModel`` subclass; ``None`` when none is (no names, a name this
    transformers lacks, or one that names something else, such as an Auto class or a config)."""
    import transformers

    for name in names or ():
        if not isinstance(name, str):  # a malformed config.json: not a name to look up
            continue
        cls = getattr(transformers, name, None)
        if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel):
            return cls
    return None


def class_for_type(model_type: Any, *, causal_lm: bool) -> type | None:
    """The class ``from_pretrained`` of an Auto class builds for a config that names no
    ``architectures``, from its ``model_type``: ``AutoModelForCausalLM``'s when the weights
    hold an output head (``causal_lm``), else ``AutoModel``'s (also when the type has no
    causal-LM class). None when transformers does not know the type."""
    from transformers import AutoModel, AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        return None
    config_class = CONFIG_MAPPING[model_type]
    for auto in (AutoModelForCausalLM, AutoModel) if causal_lm else (AutoModel,):
        if config_class in auto._model_mapping:
            return auto._model_mapping[config_class]
    return None


def model_class(config) -> type:
    """The class the checkpoint was saved from (``config.architectures``), else AutoModel's class
    for this config object's type.

    Raises BadInput when transformers knows neither (a model type newer than it)."""
    cls = architecture_class(getattr(config, "architectures", None))
    if cls is not None:
        return cls
    import transformers
    from transformers import AutoModel

    mapping = AutoModel._model_mapping
    if type(config) not in mapping:
        raise BadInput(f"config.json: model type {config.model_type!r} is unknown to transformers "
                       f"{transformers.__version__}; upgrade transformers")
    return mapping[type(config)]


def build_from_config(config) -> nn.Module:
    """An instance of the config's model, built where the caller's ``torch.device`` says (meta
    for counting): the ``architectures`` class, else ``AutoModelForCausalLM``, else the bare
    ``AutoModel`` for configs with no causal-LM head (BERT, T5 encoders...).

    Raises whatever transformers raises for a config it cannot build."""
    cls = architecture_class(getattr(config, "architectures", None))
    if cls is not None:
        return cls(config)
    from transformers import AutoModel, AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_config(config)
    except ValueError:  # not a causal LM: the bare model still has every parameter to count
        return AutoModel.from_config(config)
