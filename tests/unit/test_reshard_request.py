"""A reshard request file is checked for its shape on its own, before the model's rules: every
way it can be wrong is one line saying what, and it is renamed aside (with a counter, so that
an earlier rejected request is kept)."""

from __future__ import annotations

import pytest

from megatron_ext.reshard.request import RequestError, read_request, retire

REFUSED = {
    "garbage": (b"\x00\x9f{not json", "is not valid JSON"),
    "empty": (b"", "is not valid JSON"),
    "truncated": (b'{"layout": {"tp": 1', "is not valid JSON"),
    "capitalised_key": (b'{"Layout": {"tp": 1}}', "unknown key(s) ['Layout']"),
    "extra_key": (b'{"layout": {"tp": 1}, "when": 5}', "unknown key(s) ['when']"),
    "no_layout": (b"{}", "has no 'layout'"),
    "null_layout": (b'{"layout": null}', "'layout' is null"),
    "list": (b'[{"layout": {"tp": 1}}]', "must be a JSON object"),
    "layout_list": (b'{"layout": [1, 2]}', "'layout' is list"),
    "unknown_size": (b'{"layout": {"tensor": 2}}', "unknown size(s) ['tensor']"),
    "string_size": (b'{"layout": {"tp": "2"}}', 'layout.tp must be a positive integer, got "2"'),
    "zero_size": (b'{"layout": {"pp": 0}}', "layout.pp must be a positive integer, got 0"),
    "bool_size": (b'{"layout": {"dp": true}}', "layout.dp must be a positive integer, got true"),
    "float_size": (b'{"layout": {"dp": 2.0}}', "layout.dp must be a positive integer, got 2.0"),
    "null_tp": (b'{"layout": {"tp": null}}', "layout.tp must be a positive integer, got null"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_a_malformed_request_is_one_line_saying_what_is_wrong(tmp_path, case):
    content, expected = REFUSED[case]
    path = tmp_path / "request.json"
    path.write_bytes(content)
    with pytest.raises(RequestError) as refused:
        read_request(str(path))
    assert expected in str(refused.value)
    assert "\n" not in str(refused.value)


ACCEPTED = {
    "sizes": (b'{"layout": {"tp": 1, "pp": 2}}', {"tp": 1, "pp": 2}),
    "no_interleaving": (b'{"layout": {"vpp": null}}', {"vpp": None}),
    "nothing_changes": (b'{"layout": {}}', {}),
}


@pytest.mark.parametrize("case", ACCEPTED)
def test_a_well_formed_request_gives_its_layout(tmp_path, case):
    content, layout = ACCEPTED[case]
    path = tmp_path / "request.json"
    path.write_bytes(content)
    assert read_request(str(path)) == layout


def test_rejected_requests_are_kept_side_by_side_and_done_is_replaced(tmp_path):
    path = tmp_path / "request.json"
    names = []
    for content in ("a", "b", "c"):
        path.write_text(content)
        names.append(retire(str(path), "rejected"))
    assert names == [f"{path}.rejected", f"{path}.rejected.1", f"{path}.rejected.2"]
    assert [(tmp_path / n).read_text() for n in names] == ["a", "b", "c"]
    for content in ("d", "e"):
        path.write_text(content)
        assert retire(str(path), "done") == f"{path}.done"
    assert (tmp_path / "request.json.done").read_text() == "e" and not path.exists()


def test_a_request_that_cannot_be_renamed_is_reported_as_such(tmp_path):
    assert retire(str(tmp_path / "gone.json"), "rejected") is None
