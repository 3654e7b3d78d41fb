"""Loading the model a user names (``--model``, ``--draft-model``): what mlx-lm cannot load is
the user's to fix, said in one line.

The argparse types in :mod:`mlx_fill.core.errors` check that a folder has the files mlx-lm reads;
what is in them (a config that is not a JSON object, an unknown ``model_type``, truncated or
mis-shaped weights, a broken tokenizer) is found only by loading it, here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mlx_fill.core.errors import UserError


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__


def load_model_folder(ref: str | Path, *, tokenizer: bool = True) -> tuple[Any, Any]:
    """``mlx_lm.load(ref)`` (``tokenizer``) or ``mlx_lm.utils.load_model(ref)``: (model,
    tokenizer or config). Raises :class:`UserError` when mlx-lm cannot load ``ref``: a local
    folder's contents, or a Hugging Face repo id that could not be downloaded. Everything raised
    inside mlx-lm's loading is read as the folder's fault: mlx-lm parses only the user's files."""
    from mlx_lm import load
    from mlx_lm.utils import load_model
    try:
        loaded = load(str(ref)) if tokenizer else load_model(Path(ref))
    except Exception as err:  # noqa: BLE001 -- see the docstring
        if not Path(ref).exists():
            raise UserError(f"could not download {ref} from the Hugging Face Hub ({_first_line(err)}); "
                            f"pass a local mlx-lm model directory") from err
        raise UserError(f"{ref}: mlx-lm cannot load this model ({_first_line(err)}); pass an "
                        f"mlx-lm model directory, such as the one `mlx-fill fixture qwen3-json` "
                        f"prints") from err
    if tokenizer:
        check_tokenizer(ref, loaded[1])
    return loaded


def check_tokenizer(ref: str | Path, tokenizer: Any) -> None:
    """:class:`UserError` when the folder's tokenizer cannot serve a request: it encodes text
    to no ids (mlx-lm builds an empty one when the tokenizer files are missing), or its chat
    template does not compile (a template that refuses this one message is left to requests)."""
    import jinja2
    if not tokenizer.encode("hello", add_special_tokens=False):
        raise UserError(f"{ref}: the tokenizer encodes text to no ids (are tokenizer.json and "
                        f"tokenizer_config.json missing?); pass a model directory with its tokenizer")
    if not isinstance(getattr(tokenizer, "chat_template", None), str):
        return
    try:
        tokenizer.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=False,
                                      add_generation_prompt=True)
    except jinja2.TemplateSyntaxError as err:
        raise UserError(f"{ref}: the chat template does not compile ({_first_line(err)}, line "
                        f"{err.lineno}); fix the folder's chat template") from err
    except Exception:  # noqa: BLE001 -- a template may refuse one lone message; requests say so
        pass


def require_chat_template(ref: str | Path, tokenizer: Any) -> None:
    """:class:`UserError` when the folder's tokenizer has no chat template (a base model's: a
    chat request cannot be rendered)."""
    if not getattr(tokenizer, "chat_template", None):
        raise UserError(f"{ref} has no chat template (tokenizer_config.json 'chat_template' or "
                        f"chat_template.jinja); pass a chat model's folder")


def vocab_size(model: Any) -> int | None:
    """The logits width of a loaded mlx-lm model (its ``args.vocab_size``, or its text
    model's for one that nests it under ``text_config``), or None."""
    args = getattr(model, "args", None)
    size = getattr(args, "vocab_size", None)
    if size is None and isinstance(getattr(args, "text_config", None), dict):
        size = args.text_config.get("vocab_size")
    return size if isinstance(size, int) and size > 0 else None
