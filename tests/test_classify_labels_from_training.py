"""label2id is built from the training rows after the split, as docs/classify.md says: a class that the split puts
wholly in validation is an error naming it, never a class the model is built for but never sees."""

from pathlib import Path

from conftest import sentiment_rows, write_tsv
from surefit.config.task_configs import ClassifyConfig
from surefit.data.summary import ClassifyFacts
from surefit.errors import DataError
from surefit.tasks.classify import load_data


def test_label2id_comes_from_the_training_split(tmp_path: Path):
    rows = sentiment_rows(40)
    rows[7]["label"] = "rare"  # one row of a third class
    data = write_tsv(tmp_path / "train.tsv", rows)
    outcomes = set()
    for seed in range(12):
        cfg = ClassifyConfig(data=str(data), val_fraction=0.25, seed=seed, output_dir=str(tmp_path / "o"))
        try:
            train, val, _, spec, report = load_data(cfg, say=lambda _: None)
        except DataError as e:
            assert "1 label in" in str(e) and "(validation split) never appears in training" in str(e)
            assert "'rare'" in str(e) and "line 9" in str(e)
            outcomes.add("held out")
            continue
        assert any(r.fields["label"] == "rare" for r in train)
        assert report.facts_as(ClassifyFacts).label2id == {"neg": 0, "pos": 1, "rare": 2}
        outcomes.add("trained")
    assert outcomes == {"held out", "trained"}  # both ways the split can fall were seen


def test_without_the_rare_class_nothing_changes(tmp_path: Path):
    data = write_tsv(tmp_path / "train.tsv", sentiment_rows(40))
    cfg = ClassifyConfig(data=str(data), val_fraction=0.25, output_dir=str(tmp_path / "o"))
    _, _, _, spec, report = load_data(cfg, say=lambda _: None)
    assert report.facts_as(ClassifyFacts).label2id == {"neg": 0, "pos": 1}
