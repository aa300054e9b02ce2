"""Slot files: llama-server's `POST /slots/{id}?action=save|restore|erase` with `--slot-save-path`.

A slot's K/V cells and tokens go to a file in the server's slot directory (llama.cpp's sequence state format,
the one llama-server writes), and come back into any slot of a server running the same model and config: a
long system prompt or document prefilled once survives a restart. Files live in one directory set by the
operator (`slot_save_path`); a request names a file, never a path, so no request reaches outside it. Pure
validation and answers here; the engine does the work on its step thread once the slot is idle.
"""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from serving.front.errors import APIError

MAX_FILENAME = 255
NOT_ENABLED = ("slot files are off on this server: start it with slot_save_path=DIR (llama-server's "
               "--slot-save-path)")


class SlotAction(str, Enum):
    save = "save"
    restore = "restore"
    erase = "erase"


class SlotFileBody(BaseModel):
    """The body of a save or restore: the file's name inside the slot directory."""

    model_config = ConfigDict(extra="forbid")

    filename: str = Field(description="a file name in the server's slot directory: no path separators, not "
                                      "'.' or '..', at most 255 characters")


def slot_file(directory: Path | None, body: SlotFileBody | None, action: SlotAction) -> Path | None:
    """The file an action names, inside `directory`; None for erase. APIError (400 without a slot
    directory, and for a missing or unsafe name; 404 for a restore of a file that is not there).

    Without a slot directory llama-server answers 501; a 4xx here, because clients retry a 5xx (the openai
    client does) and this request cannot succeed until the operator sets slot_save_path."""
    if directory is None:
        raise APIError(400, NOT_ENABLED, code="slot_files_off")
    if action is SlotAction.erase:
        return None
    if body is None:
        raise APIError(400, f"action {action.value} needs a JSON body with a 'filename'", param="filename")
    name = body.filename
    if (not name or len(name) > MAX_FILENAME or name in (".", "..") or "/" in name or "\\" in name
            or "\x00" in name or name != name.strip()):
        raise APIError(400, f"invalid filename {name[:80]!r}: give a plain file name (no path separators, not "
                            f"'.' or '..', no leading or trailing spaces, at most {MAX_FILENAME} characters)",
                       param="filename", code="invalid_filename")
    path = directory / name
    if action is SlotAction.restore and not path.is_file():
        raise APIError(404, f"no slot file named {name!r} in the slot directory", param="filename",
                       code="slot_file_not_found")
    return path


def saved_answer(slot_id: int, filename: str, n_tokens: int, n_bytes: int, ms: float) -> dict[str, Any]:
    return {"id_slot": slot_id, "filename": filename, "n_saved": n_tokens, "n_written": n_bytes,
            "timings": {"save_ms": round(ms, 3)}}


def restored_answer(slot_id: int, filename: str, n_tokens: int, n_bytes: int, ms: float) -> dict[str, Any]:
    return {"id_slot": slot_id, "filename": filename, "n_restored": n_tokens, "n_read": n_bytes,
            "timings": {"restore_ms": round(ms, 3)}}


def erased_answer(slot_id: int, n_tokens: int) -> dict[str, Any]:
    return {"id_slot": slot_id, "n_erased": n_tokens}
