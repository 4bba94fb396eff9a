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
