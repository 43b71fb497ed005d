// The data behind the Model view, without widgets: summarize_checkpoint() on tiny checkpoints, the
// number formats it shows, and the recent-checkpoints list rules.
#include <QDir>
#include <QTemporaryDir>
#include <QtTest>
#include <cstdlib>
#include <filesystem>

#include "core/util/error.h"
#include "gui/tiny_checkpoint.h"
#include "model_summary.h"
#include "recent_checkpoints.h"

namespace fs = std::filesystem;
using namespace hh::workbench;
using hh::test::TinySpec;

Q_DECLARE_METATYPE(TinySpec)

namespace {
// Length of "sha256:" followed by 64 hex digits.
constexpr int kFingerprintLength = 7 + 64;

fs::path scratchRoot() {
  const char* tmp = std::getenv("HH_TEST_TMP");
  fs::path root = (tmp && *tmp) ? fs::path(tmp) : fs::temp_directory_path();
  return root / "gui_model_summary";
}
}  // namespace

class TestModelSummary : public QObject {
  Q_OBJECT

 private Q_SLOTS:
  void initTestCase() {
    fs::remove_all(scratchRoot());
    fs::create_directories(scratchRoot());
  }

  void formatParameterCount_data() {
    QTest::addColumn<qint64>("count");
    QTest::addColumn<QString>("expected");
    QTest::newRow("zero") << qint64(0) << "0";
    QTest::newRow("below thousand") << qint64(999) << "999";
    QTest::newRow("thousands") << qint64(1500) << "1.5 K";
    QTest::newRow("qwen3-0.6b") << qint64(596049920) << "596.0 M";
    QTest::newRow("exact million") << qint64(1000000) << "1.0 M";
    QTest::newRow("qwen3-8b") << qint64(8190735360) << "8.19 B";
  }
  void formatParameterCount() {
    QFETCH(qint64, count);
    QFETCH(QString, expected);
    QCOMPARE(QString::fromStdString(format_parameter_count(count)), expected);
  }

  void groupDigits_data() {
    QTest::addColumn<qint64>("value");
    QTest::addColumn<QString>("expected");
    QTest::newRow("small") << qint64(7) << "7";
    QTest::newRow("three digits") << qint64(999) << "999";
    QTest::newRow("four digits") << qint64(1024) << "1,024";
    QTest::newRow("vocab") << qint64(151936) << "151,936";
    QTest::newRow("million") << qint64(1000000) << "1,000,000";
    QTest::newRow("negative") << qint64(-131072) << "-131,072";
  }
  void groupDigits() {
    QFETCH(qint64, value);
    QFETCH(QString, expected);
    QCOMPARE(QString::fromStdString(group_digits(value)), expected);
  }

  void formatShape() {
    QCOMPARE(QString::fromStdString(format_shape({151936, 1024})), QStringLiteral("[151936, 1024]"));
    QCOMPARE(QString::fromStdString(format_shape({128})), QStringLiteral("[128]"));
    QCOMPARE(QString::fromStdString(format_shape({})), QStringLiteral("[]"));
  }

  void fingerprintPrefix() {
    const std::string fp = "sha256:" + std::string(64, 'a');
    QCOMPARE(QString::fromStdString(fingerprint_prefix(fp)), QStringLiteral("sha256:aaaaaaaaaaaa"));
    QCOMPARE(QString::fromStdString(fingerprint_prefix(fp, 4)), QStringLiteral("sha256:aaaa"));
    QCOMPARE(QString::fromStdString(fingerprint_prefix("sha256:ab")), QStringLiteral("sha256:ab"));
  }

  void naturalLess_data() {
    QTest::addColumn<QString>("a");
    QTest::addColumn<QString>("b");
    QTest::addColumn<bool>("less");
    QTest::newRow("layer 2 before 10") << "model.layers.2.mlp" << "model.layers.10.mlp" << true;
    QTest::newRow("layer 10 after 2") << "model.layers.10.mlp" << "model.layers.2.mlp" << false;
    QTest::newRow("same layer, by text") << "model.layers.3.mlp" << "model.layers.3.self_attn" << true;
    QTest::newRow("equal") << "model.norm.weight" << "model.norm.weight" << false;
    QTest::newRow("prefix first") << "model.layers.1" << "model.layers.1.x" << true;
    QTest::newRow("letters vs digits by char") << "lm_head.weight" << "model.embed_tokens.weight" << true;
  }
  void naturalLess() {
    QFETCH(QString, a);
    QFETCH(QString, b);
    QFETCH(bool, less);
    QCOMPARE(natural_less(a.toStdString(), b.toStdString()), less);
  }

  void dtypeSummary() {
    std::vector<TensorEntry> t(4);
    for (auto& e : t) e.dtype = "BF16";
    QCOMPARE(QString::fromStdString(dtype_summary(t)), QStringLiteral("BF16"));
    t[3].dtype = "F32";
    QCOMPARE(QString::fromStdString(dtype_summary(t)), QString::fromUtf8("BF16 \u00d73, F32 \u00d71"));
    QCOMPARE(QString::fromStdString(dtype_summary({})), QString());
  }

  void summarizeTinyCheckpoint_data() {
    QTest::addColumn<TinySpec>("spec");
    QTest::addColumn<QString>("dtype");
    TinySpec gqa;
    QTest::newRow("gqa f32 tied") << gqa << "F32";
    TinySpec untied;
    untied.tied = false;
    untied.dtype = hh::io::DType::BF16;
    QTest::newRow("untied bf16") << untied << "BF16";
    TinySpec deep;  // enough layers for layers.10 to follow layers.9 in natural order
    deep.layers = 12;
    deep.heads = 8;
    deep.kv_heads = 1;
    QTest::newRow("12 layers mqa") << deep << "F32";
  }
  void summarizeTinyCheckpoint() {
    QFETCH(TinySpec, spec);
    QFETCH(QString, dtype);
    const fs::path dir = hh::test::write_tiny_checkpoint(scratchRoot() / QTest::currentDataTag(), spec);

    const ModelSummary s = summarize_checkpoint(dir);
    QCOMPARE(QString::fromStdString(s.name), QString::fromLatin1(QTest::currentDataTag()));
    QCOMPARE(s.config.num_hidden_layers, spec.layers);
    QCOMPARE(s.config.num_attention_heads, spec.heads);
    QCOMPARE(s.config.num_key_value_heads, spec.kv_heads);
    QCOMPARE(s.params_from_tensors, hh::test::tiny_parameter_count(spec));
    QCOMPARE(s.params_from_config, hh::test::tiny_parameter_count(spec));
    QVERIFY(s.params_match());
    QCOMPARE(QString::fromStdString(s.weights_dtype), dtype);
    QCOMPARE(s.tensors.size(), hh::test::tiny_tensors(spec).size());
    QCOMPARE(s.weight_files, std::vector<std::string>{"model.safetensors"});
    QVERIFY2(s.fingerprint.rfind("sha256:", 0) == 0, s.fingerprint.c_str());
    QCOMPARE(int(s.fingerprint.size()), kFingerprintLength);
    for (std::size_t i = 1; i < s.tensors.size(); ++i)
      QVERIFY2(natural_less(s.tensors[i - 1].name, s.tensors[i].name), s.tensors[i].name.c_str());
    // A tensor entry carries the header's dtype and shape.
    const auto embed = std::find_if(s.tensors.begin(), s.tensors.end(),
                                    [](const TensorEntry& t) { return t.name == "model.embed_tokens.weight"; });
    QVERIFY(embed != s.tensors.end());
    QCOMPARE(embed->shape, (std::vector<int64_t>{spec.vocab, spec.hidden}));
    QCOMPARE(QString::fromStdString(embed->dtype), dtype);
  }

  void missingTensorChangesCount() {
    TinySpec spec;
    spec.skip_tensor = "model.layers.1.mlp.down_proj.weight";
    const fs::path dir = hh::test::write_tiny_checkpoint(scratchRoot() / "missing_tensor", spec);
    const ModelSummary s = summarize_checkpoint(dir);
    QVERIFY(!s.params_match());
    QCOMPARE(s.params_from_config - s.params_from_tensors, spec.hidden * spec.intermediate);
  }

  void summarizeErrors_data() {
    QTest::addColumn<QString>("setup");
    QTest::addColumn<QString>("expected");  // part of the hh::Error message
    QTest::newRow("missing folder") << "missing" << "no such folder";
    QTest::newRow("file, not folder") << "file" << "not a folder";
    QTest::newRow("no config.json") << "no-config" << "config.json";
    QTest::newRow("no safetensors") << "no-weights" << "safetensors";
    QTest::newRow("bad field") << "bad-field" << "num_key_value_heads";
  }
  void summarizeErrors() {
    QFETCH(QString, setup);
    QFETCH(QString, expected);
    const fs::path dir = scratchRoot() / ("err-" + setup.toStdString());
    fs::remove_all(dir);
    if (setup == "file") {
      hh::test::write_text(dir, "not a checkpoint");
    } else if (setup != "missing") {
      hh::test::write_tiny_checkpoint(dir, TinySpec{});
      if (setup == "no-config") fs::remove(dir / "config.json");
      if (setup == "no-weights") fs::remove(dir / "model.safetensors");
      if (setup == "bad-field") {
        TinySpec bad;
        bad.kv_heads = 3;  // does not divide 4 query heads
        hh::test::write_text(dir / "config.json", hh::test::tiny_config_json(bad));
      }
    }
    try {
      summarize_checkpoint(dir);
      QFAIL("expected hh::Error");
    } catch (const hh::Error& e) {
      QVERIFY2(QString::fromStdString(e.what()).contains(expected), e.what());
    }
  }

  void recentList() {
    QTemporaryDir tmp;
    QVERIFY(tmp.isValid());
    QStringList dirs;
    for (int i = 0; i < kMaxRecentCheckpoints + 2; ++i) {
      dirs << QDir(tmp.path()).filePath(QStringLiteral("m%1").arg(i));
      QVERIFY(QDir().mkpath(dirs.last()));
    }
    QStringList list;
    list = withRecentCheckpoint(list, dirs[0]);
    list = withRecentCheckpoint(list, dirs[1]);
    list = withRecentCheckpoint(list, dirs[0] + "/");  // same folder, other spelling
    QCOMPARE(list, (QStringList{normalizedCheckpointPath(dirs[0]), normalizedCheckpointPath(dirs[1])}));
    for (const QString& d : dirs) list = withRecentCheckpoint(list, d);
    QCOMPARE(list.size(), kMaxRecentCheckpoints);
    QCOMPARE(list.first(), normalizedCheckpointPath(dirs.last()));
    QVERIFY(QDir(dirs.last()).removeRecursively());
    const QStringList kept = withoutMissingCheckpoints(list);
    QCOMPARE(kept.size(), kMaxRecentCheckpoints - 1);
    QVERIFY(!kept.contains(normalizedCheckpointPath(dirs.last())));
  }
};

QTEST_GUILESS_MAIN(TestModelSummary)
#include "test_model_summary.moc"
