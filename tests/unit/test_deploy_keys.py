"""The deployment's API key (deploy/keys.py, and serve up's settling of it): one format
wherever a key is read, a key file open to others refused with the fix, every file 0600
from its first byte, and a key file that disagrees with the nodes refused unless rotating."""

from __future__ import annotations

import os
import stat
import threading

import pytest

from vcfslm.deploy import keys
from vcfslm.deploy.service import settle_key
from vcfslm.errors import InputError

GOOD = "k3y-Sekr1t-0123456789abcdefABCDEF"


# Fixed parameters (a test id must be the same on every xdist worker); new_key() is checked below.
@pytest.mark.parametrize("key", ["8h9odNqeHWQ5fInjaoZlhYxGNnz5UzIPjFvWBMY2cxg", GOOD, "a" * 20,
                                 "abc.DEF_ghi~jkl+mno/pqr==", "x" * 512])
def test_keys_of_the_bearer_token_alphabet_pass(key):
    assert keys.key_problem(key) is None


@pytest.mark.parametrize(("key", "said"), [
    ('abcdefghij"klmnopqrstu', "'\"'"),                  # closes nginx's map string
    ("abcdefghij;klmnopqrstu", "';'"),                   # ends nginx's directive
    ("abcdefghij\nklmnopqrstu", "'\\n'"),                # a second line in the env file
    ("abcdefghij$(reboot)klmnopq", "'$'"),               # bash would run it
    ("abcdefghij`id`klmnopqrstu", "'`'"),
    ("abcdefghij klmnopqrstuvw", "' '"),
    ("abcdefghij=klmnopqrstuvw", "'='"),                 # = only as padding at the end
    ("short", "this one has 5"),
    ("x" * 513, "this one has 513"),
])
def test_a_key_that_would_break_nginx_or_bash_is_refused_naming_the_character(key, said):
    problem = keys.key_problem(key)
    assert problem is not None and said in problem
    assert "klmnop" not in problem        # the key itself is never quoted


def test_a_new_key_is_43_characters_of_the_url_safe_alphabet():
    key = keys.new_key()
    assert len(key) == 43 and keys.key_problem(key) is None and key != keys.new_key()


def test_the_key_file_is_0600_from_its_first_byte_and_its_folder_0700(tmp_path, monkeypatch):
    path = tmp_path / "new" / "slm.key"
    modes = []
    real_open = os.open

    def watching_open(file, flags, mode=0o777, *a, **kw):
        fd = real_open(file, flags, mode, *a, **kw)
        if flags & os.O_CREAT:
            modes.append(stat.S_IMODE(os.fstat(fd).st_mode))
        return fd

    monkeypatch.setattr(os, "open", watching_open)
    os.umask(0o022)
    keys.write_key_file(path, GOOD)
    assert modes == [0o600]                                    # created private, before anything is written
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert path.read_text() == GOOD + "\n"
    assert [p.name for p in path.parent.iterdir()] == ["slm.key"]    # no temporary file left


def test_writing_over_a_key_file_replaces_it_whole(tmp_path):
    path = tmp_path / "slm.key"
    keys.write_key_file(path, GOOD)
    keys.write_key_file(path, "b" * 30)
    assert path.read_text() == "b" * 30 + "\n" and stat.S_IMODE(path.stat().st_mode) == 0o600


def test_a_key_file_open_to_group_or_others_is_refused_with_the_fix(tmp_path):
    path = tmp_path / "slm.key"
    keys.write_key_file(path, GOOD)
    for mode in (0o644, 0o640, 0o604, 0o660):
        path.chmod(mode)
        with pytest.raises(keys.KeyFileError) as info:
            keys.read_key_file(path)
        assert info.value.exit_code == 2 and isinstance(info.value, InputError)
        assert f"chmod 600 {path}" in str(info.value) and f"{mode:04o}" in str(info.value)
        assert GOOD not in str(info.value)
    path.chmod(0o600)
    assert keys.read_key_file(path) == GOOD
    path.chmod(0o400)
    assert keys.read_key_file(path) == GOOD


@pytest.mark.parametrize(("content", "said"), [("", "is empty"), ("\n", "is empty"),
                                               ('bad"key-0123456789abcdef\n', "'\"'"),
                                               (GOOD + "\nsecond line\n", "'\\n'")])
def test_a_key_file_that_holds_no_usable_key_is_refused(tmp_path, content, said):
    path = tmp_path / "slm.key"
    keys.write_private(path, content)
    with pytest.raises(keys.KeyFileError) as info:
        keys.read_key_file(path)
    assert said in str(info.value) and str(path) in str(info.value) and info.value.exit_code == 2


def test_a_missing_key_file_is_named(tmp_path):
    with pytest.raises(keys.KeyFileError, match="cannot read the API key"):
        keys.read_key_file(tmp_path / "none.key")


def test_a_node_key_is_checked_as_a_key_file_is():
    assert keys.key_of_env(f"VLLM_API_KEY={GOOD}\n", "slm-01:/x/serve.env") == GOOD
    assert keys.key_of_env("OTHER=1\n", "n") is None and keys.key_of_env("VLLM_API_KEY=\n", "n") is None
    with pytest.raises(keys.KeyFileError) as info:
        keys.key_of_env("VLLM_API_KEY=abc;$(rm -rf /)0123456789\n", "slm-01:/x/serve.env")
    assert "slm-01:/x/serve.env" in str(info.value) and "rm -rf" not in str(info.value)


def test_the_env_file_and_the_door_take_checked_keys_only():
    assert keys.env_text(GOOD) == f"VLLM_API_KEY={GOOD}\n"
    with pytest.raises(ValueError):
        keys.env_text("a;b" * 10)
    assert keys.check_keys([GOOD, "b" * 30]) == [GOOD, "b" * 30]
    with pytest.raises(ValueError):
        keys.check_keys([])
    with pytest.raises(ValueError):
        keys.check_keys([GOOD, 'x"' * 12])


# ------------------------------------------------------------------ serve up's key


def key_file(tmp_path, key: str | None = GOOD):
    path = tmp_path / "slm.key"
    if key is not None:
        keys.write_key_file(path, key)
    return str(path)


def test_the_key_file_agreeing_with_the_nodes_is_used_and_not_rewritten(tmp_path):
    assert settle_key(key_file(tmp_path), False, [GOOD, GOOD]) == (GOOD, False)
    assert settle_key(key_file(tmp_path), False, []) == (GOOD, False)        # first up with the operator's key


def test_a_key_file_that_disagrees_with_the_nodes_is_an_error_unless_rotating(tmp_path):
    other = "o" * 30
    with pytest.raises(keys.KeyFileError) as info:
        settle_key(key_file(tmp_path), False, [other])
    assert "--rotate-key" in str(info.value) and info.value.exit_code == 2
    assert GOOD not in str(info.value) and other not in str(info.value)
    assert settle_key(key_file(tmp_path), True, [other]) == (GOOD, False)    # the nodes take the file's


def test_rotating_with_the_nodes_key_in_the_file_makes_a_new_one_to_save(tmp_path):
    key, save = settle_key(key_file(tmp_path), True, [GOOD])
    assert key != GOOD and save and keys.key_problem(key) is None


def test_without_a_key_file_the_nodes_key_is_saved_else_a_new_one(tmp_path):
    missing = key_file(tmp_path, None)
    assert settle_key(missing, False, [None, GOOD]) == (GOOD, True)
    key, save = settle_key(missing, False, [None])
    assert save and key != GOOD and keys.key_problem(key) is None


def test_a_readable_key_file_is_refused_before_anything_is_settled(tmp_path):
    path = key_file(tmp_path)
    os.chmod(path, 0o644)
    with pytest.raises(keys.KeyFileError, match="chmod 600"):
        settle_key(path, False, [GOOD])


def test_concurrent_writers_never_leave_a_partial_key(tmp_path):
    path = tmp_path / "slm.key"
    writers = [threading.Thread(target=keys.write_key_file, args=(path, c * 40)) for c in "abcdefgh"]
    for w in writers:
        w.start()
    for w in writers:
        w.join()
    text = path.read_text()
    assert len(text) == 41 and len(set(text.strip())) == 1
