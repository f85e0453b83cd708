"""A stage checkpoints to and resumes from a real S3 server (SeaweedFS on loopback); credentials never leak."""

import pytest
from transformers import AutoModelForCausalLM

from rlhf_core.config import load_config, to_yaml
from rlhf_core.jobs import sft
from rlhf_core.storage import ObjectStore
from tests.conftest import TINY
from tests.conftest_s3 import s3_storage_options

# make test-all only: a stage on the S3 server, its resume and credentials are proven in make test by test_secrets.py
# and test_store_outage.py
pytestmark = [pytest.mark.slow, pytest.mark.extended]


def test_sft_on_s3_resumes_and_keeps_credentials_out(s3_server, ray_cluster, monkeypatch, tmp_path, capfd):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server.key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.secret)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint_url)
    run_uri = f"s3://{s3_server.bucket}/runs/{tmp_path.name}"
    overrides = [f"run_uri={run_uri}", "sft.data.max_samples=96", "sft.train.save_steps=2"]
    cfg = load_config(TINY, overrides)

    monkeypatch.setenv("RLHF_FAIL_AFTER_STEP", "2")
    with pytest.raises(Exception, match="injected failure after checkpoint at step 2"):
        sft.run(cfg)
    monkeypatch.delenv("RLHF_FAIL_AFTER_STEP")
    ref = sft.run(cfg)
    assert ref.uri == f"{run_uri}/sft" and ref.metrics["resumed_from_step"] == 2 and ref.step == 6

    store = ObjectStore(run_uri, s3_storage_options(s3_server))
    manifest = store.read_manifest("sft")  # verifies every file's sha256 on the server
    local = tmp_path / "sft"
    store.download_artifact("sft", str(local))
    AutoModelForCausalLM.from_pretrained(str(local))

    # Credentials given in the config instead of the environment work the same and are redacted when shown.
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with_secret = load_config(TINY, [*overrides, f"storage.secret={s3_server.secret}"])
    assert sft.run(with_secret).config_hash == ref.config_hash  # already complete: nothing to do
    assert s3_server.secret not in to_yaml(with_secret)

    shown = capfd.readouterr()
    texts = [manifest.to_json(), store.read_text("sft/metrics.json"), shown.out, shown.err, repr(store)]
    texts += [store.read_text(f"sft/checkpoints/{d}/manifest.json") for d in store.list_dirs("sft/checkpoints")]
    assert not [t for t in texts if s3_server.secret in t or s3_server.key in t]
