"""The mask token: one special token, with no new parameter where the embedding has a spare row.

MARS adds no parameter to the model. Qwen2.5 pads its embedding matrix beyond the tokenizer's
vocabulary, so ``<|mask|>`` lands on a spare row and nothing is resized. A model without spare rows
(SmolLM2, a tiny Llama) gets exactly one new row, and the resize is recorded so a checkpoint says so.
An existing unused special token can be named instead: then nothing is added at all.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from mars.errors import MarsError

MASK_TOKEN = "<|mask|>"


class MaskTokenError(MarsError):
    pass


@dataclass(frozen=True)
class MaskTokenInfo:
    token: str
    token_id: int
    added_to_tokenizer: bool  # False when an existing token was reused
    resized: bool  # True when the embedding matrix grew by one row
    embedding_rows_before: int
    embedding_rows_after: int

    def to_dict(self) -> dict:
        return asdict(self)


def add_mask_token(model, tokenizer, token: str = MASK_TOKEN, *, allow_resize: bool = True) -> MaskTokenInfo:
    """Register ``token`` as the mask token of ``tokenizer`` and make sure ``model`` has a row for it.

    - ``token`` already in the vocabulary (a reused unused special token, or a second call): its id is used.
    - otherwise it is added as a special token; it takes the next id, which is a spare embedding row if
      the matrix has one. With no spare row, one row is added (``allow_resize``) or MaskTokenError is raised.
    The new row starts at the mean of the existing rows, so the token starts out as "an average token".
    """
    rows_before = model.get_input_embeddings().num_embeddings
    vocab = tokenizer.get_vocab()
    added = token not in vocab
    if added:
        if len(tokenizer) >= rows_before and not allow_resize:
            raise MaskTokenError(
                f"no room for mask token {token!r}: the tokenizer has {len(tokenizer)} tokens and the embedding "
                f"{rows_before} rows, and resizing is not allowed (name an unused special token instead)"
            )
        tokenizer.add_special_tokens({"additional_special_tokens": [token]}, replace_extra_special_tokens=False)
    token_id = tokenizer.convert_tokens_to_ids(token)
    if token_id is None or token_id == tokenizer.unk_token_id and token != tokenizer.unk_token:
        raise MaskTokenError(f"tokenizer could not register mask token {token!r}")
    if tokenizer.encode(token, add_special_tokens=False) != [token_id]:
        raise MaskTokenError(f"mask token {token!r} does not tokenize to a single id")
    resized = token_id >= rows_before
    if resized:
        if not allow_resize:
            raise MaskTokenError(f"mask token id {token_id} is beyond the {rows_before} embedding rows")
        _grow_embeddings(model, token_id + 1)
    if tokenizer.pad_token is None:
        # Padding is masked out everywhere; reuse EOS rather than adding another token.
        tokenizer.pad_token = tokenizer.eos_token
    info = MaskTokenInfo(
        token=token,
        token_id=int(token_id),
        added_to_tokenizer=added,
        resized=resized,
        embedding_rows_before=rows_before,
        embedding_rows_after=model.get_input_embeddings().num_embeddings,
    )
    model.config.mask_token_id = info.token_id
    return info


def _grow_embeddings(model, rows: int) -> None:
    old = model.get_input_embeddings().weight.detach()
    model.resize_token_embeddings(rows, mean_resizing=False)
    with torch.no_grad():
        mean = old.float().mean(0).to(old.dtype)
        model.get_input_embeddings().weight[old.shape[0]:] = mean
        out = model.get_output_embeddings()
        if out is not None and out.weight.data_ptr() != model.get_input_embeddings().weight.data_ptr():
            out.weight[old.shape[0]:] = out.weight[: old.shape[0]].float().mean(0).to(out.weight.dtype)


def mask_token_id(model_or_config, tokenizer=None) -> int:
    """The mask token id a checkpoint was trained with; a clear error if it has none."""
    from mars.core.checkpoint_info import CheckpointInfo

    config = getattr(model_or_config, "config", model_or_config)
    info = CheckpointInfo.from_config(config)
    # a base model (`mars base`) records only config.mask_token_id: it has no training to describe yet
    token_id = info.mask_token_id if info is not None else getattr(config, "mask_token_id", None)
    if token_id is None and tokenizer is not None and MASK_TOKEN in tokenizer.get_vocab():
        token_id = tokenizer.convert_tokens_to_ids(MASK_TOKEN)
    if token_id is None:
        name = getattr(config, "_name_or_path", "") or "this model"
        raise MaskTokenError(f"{name} has no mask token: it is not a MARS checkpoint (no config.mars.mask_token_id)")
    return int(token_id)
