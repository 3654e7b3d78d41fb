"""The engine of ``mlx-fill serve``: the model, its tokenizer, the prompt cache and the fill
configuration; it renders a request, builds its fill session and generates (one worker thread
owns it: MLX work never runs on two threads)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mlx_fill.core.errors import UserError
from mlx_fill.core.index import IndexStore
from mlx_fill.limits import DEFAULT_LIMITS, Limits, over_compile_budget
from .openai_request import ChatRequest, RequestError, parse_chat_request
from .output import OutputSplitter
from .template_vars import tokenizer_template_variables


DEFAULT_MAX_TOKENS = 512
STORE_SEED_NEEDS_ALL = ("--store-seed fills the cross-request store, which only --fill all drafts "
                        "from; pass --fill all")
STORE_TOKENS_NEEDS_ALL = ("--store-tokens bounds the cross-request store, which only --fill all "
                          "keeps; pass --fill all or drop --store-tokens")
DRAFT_MODEL_NEEDS_FILL = ("--draft-model proposes through fill, which --fill off turns off; pass "
                          "--fill strict, echo or all, or drop --draft-model")
DEFAULT_PREFILL_STEP = 2048
DEFAULT_PROMPT_CACHE_BYTES = 8 << 30


class PrefillCancelled(Exception):
    """Raised between prefill chunks when the client left or the server is shutting down."""


@dataclass
class Outcome:
    """One finished generation."""

    text: str
    tokens: list[int]
    finish_reason: str
    prompt_tokens: int
    cached_tokens: int
    usage_extra: dict = field(default_factory=dict)


class Engine:
    """The model, its tokenizer, the prompt cache and the fill configuration. Not thread-safe:
    :class:`App` calls it from one worker thread only. With ``mode="all"`` the suffix source
    drafts from a cross-request store bounded by ``store_tokens`` ids (default
    ``MLX_FILL_STORE_TOKENS``, as the in-server hook's store), which ``store_seed``
    (called once with the tokenizer and the empty store; refused in other modes) fills at
    start. ``store_tokens`` and ``draft_model`` are refused in a mode that does not use them
    (``store_tokens`` outside ``all``, ``draft_model`` with ``off``)."""

    def __init__(self, model_path: str, *, mode: str = "strict", draft_model: str | None = None,
                 prompt_cache_size: int = 8, max_tokens: int = DEFAULT_MAX_TOKENS,
                 limits: Limits = DEFAULT_LIMITS, prefill_step_size: int = DEFAULT_PREFILL_STEP,
                 prompt_cache_bytes: int = DEFAULT_PROMPT_CACHE_BYTES, dtype: str | None = None,
                 store_tokens: int | None = None,
                 store_seed: Callable[[Any, Any], None] | None = None):
        from mlx_lm.models.cache import LRUPromptCache

        from mlx_fill.core.model_folder import load_model_folder, require_chat_template

        from mlx_fill.session import check_env, check_mode, env_store_tokens, keeps_index
        self.model_path = model_path
        self.mode = check_mode(mode)
        if store_seed is not None and self.mode != "all":
            raise UserError(STORE_SEED_NEEDS_ALL)
        if store_tokens is not None and self.mode != "all":
            raise UserError(STORE_TOKENS_NEEDS_ALL)
        if draft_model is not None and self.mode == "off":
            raise UserError(DRAFT_MODEL_NEEDS_FILL)
        check_env()
        from mlx_fill.core.resolve import prepare  # dispatch plans: qualified at start-up, not in a request
        from mlx_fill.strict.source import warm_strict  # a tokenizer's strict costs: at start-up too
        self.model, self.tokenizer = load_model_folder(model_path)
        require_chat_template(model_path, self.tokenizer)
        if dtype is not None:  # the floating-point weights cast, as model.set_dtype does
            import mlx.core as mx
            self.model.set_dtype(getattr(mx, dtype))
            # evaluated here: a lazy cast recorded on this thread's stream cannot be evaluated
            # by the worker thread that generates ("There is no Stream(cpu, 0) in current thread")
            mx.eval(self.model.parameters())
        if self.mode != "off":
            prepare(self.model)
            warm_strict(self.tokenizer)
        self.draft = None
        if draft_model is not None:
            from mlx_fill.spec.draft import TokenizerMismatch, check_same_tokenizer
            self.draft, draft_tokenizer = load_model_folder(draft_model)
            try:
                check_same_tokenizer(draft_tokenizer, self.tokenizer)
            except TokenizerMismatch as err:
                raise UserError(f"--draft-model {draft_model}: {err}; pass a model with the "
                                f"target's tokenizer") from err
            if self.mode != "off":
                prepare(self.draft)
        self.prompt_cache = LRUPromptCache(prompt_cache_size, max_bytes=prompt_cache_bytes)
        self.limits = limits
        self.max_tokens = min(max_tokens, limits.max_tokens_ceiling)
        self.prefill_step_size = prefill_step_size
        self.template_vars = tokenizer_template_variables(self.tokenizer)
        self.stopping = threading.Event()  # set at shutdown: every generation stops
        self.ledger = None
        if self.mode != "off":
            from mlx_fill.session import server_ledger
            try:
                self.ledger = server_ledger(str(model_path), self.tokenizer)
            except ValueError as e:  # a corrupt or foreign ledger file: the user's to move away
                raise UserError(f"{e}; move the file away to start a new ledger") from None
        self.acceptance: dict = {}  # per-draft acceptance estimates, kept for the server's lifetime
        # the model-free sources' conversation indexes, kept between requests
        self.indexes = IndexStore() if keeps_index(self.mode) else None
        self.global_tree = None
        if self.mode == "all":
            from mlx_fill.spec.suffix import GlobalSuffixTree
            self.global_tree = GlobalSuffixTree(
                max_tokens=store_tokens if store_tokens is not None else env_store_tokens())
            if store_seed is not None:
                store_seed(self.tokenizer, self.global_tree)

    def parse(self, body: Any) -> ChatRequest:
        """:func:`parse_chat_request` under this engine's limits and template variables."""
        return parse_chat_request(body, limits=self.limits, template_vars=self.template_vars)

    def render(self, req: ChatRequest) -> list[int]:
        """The prompt ids; RequestError (400 ``context_length_exceeded``) above
        ``limits.max_prompt_tokens``, and (400) when the template rejects the messages or
        renders nothing of their ``developer`` messages (many templates know no such role and
        skip it: the request would lose them)."""
        ids = self._apply_template(req, req.messages)
        developer = [i for i, m in enumerate(req.messages) if m["role"] == "developer"]
        if developer:
            def probed(text: str) -> list[int]:  # every developer message's content replaced
                return self._apply_template(req, [{**m, "content": text} if m["role"] == "developer"
                                                  else m for m in req.messages])
            if probed("a") == probed("b"):
                raise RequestError(400, f"messages[{developer[0]}].role: the model's chat "
                                        f"template does not render 'developer' messages; send "
                                        f"them as 'system'", f"messages[{developer[0]}].role")
        if len(ids) > self.limits.max_prompt_tokens:
            raise RequestError(400, f"messages: the rendered prompt is {len(ids)} tokens, at most "
                                    f"{self.limits.max_prompt_tokens}", "messages",
                               "context_length_exceeded")
        return ids

    def _apply_template(self, req: ChatRequest, messages: list[dict]) -> list[int]:
        """``messages`` rendered with the request's tools and template variables, as ids."""
        try:
            return list(self.tokenizer.apply_chat_template(
                messages, tools=req.shown_tools, add_generation_prompt=True, tokenize=True,
                **req.chat_template_kwargs))
        except Exception as e:  # noqa: BLE001 -- template errors are the request's (e.g. a role it rejects)
            raise RequestError(400, f"messages: the model's chat template rejected the request "
                                    f"({type(e).__name__}: {e})", "messages") from None

    def _session(self, req: ChatRequest, prompt_ids: list[int], predicted: list[int] | None):
        from mlx_fill.session import build_session
        refuse = "compile_budget" if over_compile_budget(req.shown_tools, self.limits) else None
        session = build_session(
            self.mode, model=self.model, tokenizer=self.tokenizer, prompt_ids=prompt_ids,
            messages=req.messages, tools=req.shown_tools, template_kwargs=req.chat_template_kwargs,
            temperature=req.temperature, seed=req.seed, prediction=predicted,
            global_tree=self.global_tree, ledger=self.ledger, draft_model=self.draft,
            refuse=refuse, acceptance=self.acceptance, indexes=self.indexes)
        return session

    def _thinking_open(self, prompt_ids: list[int]) -> bool:
        """The prompt leaves a reasoning block open (the output starts inside it)."""
        start = getattr(self.tokenizer, "think_start_id", None)
        end = getattr(self.tokenizer, "think_end_id", None)
        if not getattr(self.tokenizer, "has_thinking", False) or start is None or start not in prompt_ids:
            return False
        last = len(prompt_ids) - 1 - prompt_ids[::-1].index(start)
        return end not in prompt_ids[last:]

    def _cache_for(self, prompt_ids: list[int]):
        from mlx_lm.models.cache import (
            can_trim_prompt_cache,
            make_prompt_cache,
            trim_prompt_cache,
        )
        cache, rest = self.prompt_cache.fetch_nearest_cache(self.model_path, prompt_ids)
        if cache is not None and not rest:  # exact hit: re-feed the last id for its logits
            if can_trim_prompt_cache(cache) and trim_prompt_cache(cache, 1) == 1:
                rest = prompt_ids[-1:]
            else:
                cache = None
        if cache is None:
            return make_prompt_cache(self.model), list(prompt_ids)
        return cache, list(rest)

    def prepare(self, req: ChatRequest) -> Prepared:
        """Render the prompt and build the fill session; RequestError (400) when the template or
        the fill sources reject the request. Runs on the worker thread, before any response."""
        from mlx_fill.session import prediction_ids
        prompt_ids = self.render(req)
        try:
            predicted = prediction_ids(self.tokenizer, req.prediction)
            session = self._session(req, prompt_ids, predicted)
        except ValueError as e:
            raise RequestError(400, str(e), str(e).split(":", 1)[0]) from None
        return Prepared(req, prompt_ids, session, predicted)

    def generate(self, prepared: Prepared, cancelled: threading.Event,
                 on_text: Callable[[str], None] | None = None) -> Outcome | None:
        """Run one prepared request; ``on_text`` receives content deltas as they become final
        (tool-call text and text that may still turn into a marker or stop string are held
        back). ``cancelled`` (or the engine's ``stopping``) stops it at the next token, or
        between two prefill chunks. Returns None when cancelled before its first token; a
        prefill cut short leaves no prompt-cache entry."""
        import mlx.core as mx
        from mlx_lm.sample_utils import make_sampler

        from mlx_fill.session import end_session, usage_extra
        from mlx_fill.adapters.mlx_lm import generate_step

        req, prompt_ids, session = prepared.req, prepared.prompt_ids, prepared.session
        def stop() -> bool:
            return cancelled.is_set() or self.stopping.is_set()

        def between_chunks(_done: int, _total: int) -> None:
            if stop():
                raise PrefillCancelled

        if stop():
            end_session(session)
            return None
        cache, rest = self._cache_for(prompt_ids)
        max_tokens = req.max_tokens or self.max_tokens
        sampler = make_sampler(temp=req.temperature, top_p=req.top_p)
        if req.seed is not None:
            mx.random.seed(req.seed)
        splitter = OutputSplitter(self.tokenizer, req.stop, on_text,
                                  thinking_open=self._thinking_open(prompt_ids))
        detok = self.tokenizer.detokenizer
        eos = set(self.tokenizer.eos_token_ids)
        tokens: list[int] = []
        finish = "length"
        steps = generate_step(mx.array(rest), self.model, fill=session, max_tokens=max_tokens,
                              sampler=sampler, prompt_cache=cache,
                              prefill_step_size=self.prefill_step_size,
                              prompt_progress_callback=between_chunks)
        prefilled = False
        try:
            for token, _ in steps:
                prefilled = True
                tokens.append(token)
                if stop():
                    finish = "cancelled"
                    break
                if token in eos:
                    finish = "stop"
                    break
                detok.add_token(token)
                if splitter.feed(detok.last_segment):
                    finish = "stop"
                    break
        except PrefillCancelled:
            finish = "cancelled"
        finally:
            steps.close()  # the cache now holds prompt + every yielded id
            end_session(session, self.ledger)
            if prefilled:  # a prefill cut between chunks holds only part of the prompt
                self.prompt_cache.insert_cache(self.model_path, prompt_ids + tokens, cache)
        if not prefilled:
            return None
        if finish == "length":
            detok.finalize()
            splitter.feed(detok.last_segment)
        extra = usage_extra(session, prediction=prepared.predicted, completion=tokens)
        text = splitter.finish()
        return Outcome(text, tokens, finish, len(prompt_ids), len(prompt_ids) - len(rest), extra)


@dataclass
class Prepared:
    """A request whose prompt is rendered and whose fill session (None: fill off) is built."""

    req: ChatRequest
    prompt_ids: list[int]
    session: Any
    predicted: list[int] | None  # the ids of the request's prediction (None: it has none)
