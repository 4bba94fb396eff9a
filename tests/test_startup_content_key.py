"""The start-up cache is keyed by content (startup_cache.files_identity): a model file rewritten with the same size and
the same modification time is another key; the hash is remembered by inode, size and times, and read again when any
of them changes."""

import json
import os

from surefit.startup import cache as startup_cache


def test_a_config_rewritten_with_the_same_size_and_mtime_is_another_key(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    config = model / "config.json"
    config.write_text(json.dumps({"vocab_size": 1000, "hidden_size": 64}))
    (model / "model.safetensors").write_bytes(b"\0" * 4096)
    before = startup_cache.files_identity(model)
    assert startup_cache.files_identity(model) == before  # the remembered hash: same key
    assert list((tmp_path / "startup" / "hashes").glob("*.json")) or list(
        (startup_cache.cache_dir() / "hashes").glob("*.json"))
    st = config.stat()
    config.write_text(json.dumps({"vocab_size": 9000, "hidden_size": 64}))  # same length, other content
    os.utime(config, ns=(st.st_atime_ns, st.st_mtime_ns))  # and the old modification time
    assert config.stat().st_size == st.st_size and config.stat().st_mtime_ns == st.st_mtime_ns
    after = startup_cache.files_identity(model)
    assert after != before
    assert [row[0] for row in after] == ["config.json", "model.safetensors"] and after[1] == before[1]


def test_hashes_computed_ahead_are_the_files_content_and_a_file_changed_since_is_read_again(tmp_path):
    import hashlib

    model = tmp_path / "model"
    model.mkdir()
    weights = model / "model.safetensors"
    weights.write_bytes(os.urandom(3 << 20))
    config = model / "config.json"
    config.write_text(json.dumps({"vocab_size": 1000}))
    startup_cache.hash_ahead(model)
    st = config.stat()
    config.write_text(json.dumps({"vocab_size": 9000}))  # rewritten after hashing began: same size and mtime
    os.utime(config, ns=(st.st_atime_ns, st.st_mtime_ns))
    ident = startup_cache.files_identity(model)
    assert ident == [["config.json", config.stat().st_size, hashlib.sha256(config.read_bytes()).hexdigest()],
                     ["model.safetensors", 3 << 20, hashlib.sha256(weights.read_bytes()).hexdigest()]]
    # remembered as a hash read in the foreground is: the next key reads no file
    memos = list((startup_cache.cache_dir() / "hashes").glob("*.json"))
    assert len(memos) == 2 and all(".tmp" not in m.name for m in memos)
    assert startup_cache.files_identity(model) == ident
