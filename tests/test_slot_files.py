"""serving/openai/slot_files.py: which file a slot action names, and the refusals (no engine needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from serving.front.errors import APIError
from serving.openai.slot_files import SlotAction, SlotFileBody, slot_file

pytestmark = pytest.mark.unit


def test_without_a_slot_directory_every_action_is_a_400_that_says_how_to_turn_them_on() -> None:
    for action in SlotAction:
        with pytest.raises(APIError) as exc:
            slot_file(None, SlotFileBody(filename="a.bin"), action)
        assert exc.value.status == 400 and exc.value.code == "slot_files_off"
        assert "slot_save_path" in exc.value.message


@pytest.mark.parametrize("name", ["", ".", "..", "../etc/passwd", "a/b.bin", "a\\b.bin", "x\x00y", " a.bin",
                                  "a" * 256])
def test_a_name_that_is_not_a_plain_file_name_is_400(tmp_path: Path, name: str) -> None:
    with pytest.raises(APIError) as exc:
        slot_file(tmp_path, SlotFileBody(filename=name), SlotAction.save)
    assert exc.value.status == 400 and exc.value.param == "filename" and exc.value.code == "invalid_filename"


def test_save_names_a_file_in_the_directory_restore_needs_it_there_erase_needs_none(tmp_path: Path) -> None:
    assert slot_file(tmp_path, SlotFileBody(filename="doc.bin"), SlotAction.save) == tmp_path / "doc.bin"
    with pytest.raises(APIError) as exc:
        slot_file(tmp_path, SlotFileBody(filename="doc.bin"), SlotAction.restore)
    assert exc.value.status == 404 and exc.value.code == "slot_file_not_found"
    (tmp_path / "doc.bin").write_bytes(b"x")
    assert slot_file(tmp_path, SlotFileBody(filename="doc.bin"), SlotAction.restore) == tmp_path / "doc.bin"
    assert slot_file(tmp_path, None, SlotAction.erase) is None
    with pytest.raises(APIError) as missing:
        slot_file(tmp_path, None, SlotAction.save)
    assert missing.value.status == 400 and "filename" in missing.value.message
