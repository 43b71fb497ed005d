// The workbench window with tiny checkpoints: opening, the head grid, the configuration form, error
// reporting that keeps the previous model, the recent list, drops and the navigation pages.
#include <QAction>
#include <QApplication>
#include <QDir>
#include <QLabel>
#include <QListWidget>
#include <QMenu>
#include <QMimeData>
#include <QSettings>
#include <QSignalSpy>
#include <QStandardPaths>
#include <QTabWidget>
#include <QTableView>
#include <QTimer>
#include <QtTest>
#include <cstdlib>
#include <filesystem>
#include <memory>

#include "gui/tiny_checkpoint.h"
#include "head_grid_model.h"
#include "heads_view.h"
#include "main_window.h"
#include "model_view.h"
#include "recent_checkpoints.h"
#include "settings.h"
#include "tensor_table_model.h"

namespace fs = std::filesystem;
using namespace hh::workbench;
using hh::test::TinySpec;

namespace {

fs::path scratchRoot() {
  const char* tmp = std::getenv("HH_TEST_TMP");
  fs::path root = (tmp && *tmp) ? fs::path(tmp) : fs::temp_directory_path();
  return root / "gui_model_view";
}

QString qpath(const fs::path& p) { return QString::fromStdString(p.string()); }

// Exposes the drag-and-drop handlers, so the test does not need a platform drag session.
class DropWindow : public MainWindow {
 public:
  using MainWindow::dragEnterEvent;
  using MainWindow::dropEvent;
};

std::unique_ptr<MainWindow> newWindow() {
  auto w = std::make_unique<MainWindow>();
  w->setInteractive(false);
  return w;
}

}  // namespace

class TestModelView : public QObject {
  Q_OBJECT

 private:
  fs::path checkpoint(const std::string& name, const TinySpec& spec = {}) {
    return hh::test::write_tiny_checkpoint(scratchRoot() / name, spec);
  }

 private Q_SLOTS:
  void initTestCase() {
    QStandardPaths::setTestModeEnabled(true);
    fs::remove_all(scratchRoot());
    fs::create_directories(scratchRoot());
    // Settings go to an INI file in the scratch dir, never to the user's configuration.
    QSettings::setDefaultFormat(QSettings::IniFormat);
    QSettings::setPath(QSettings::IniFormat, QSettings::UserScope, qpath(scratchRoot() / "settings"));
    QCoreApplication::setOrganizationName(QStringLiteral("HydraHeadTest"));
    QCoreApplication::setApplicationName(QStringLiteral("gui_test_model_view"));
    QSettings().clear();
  }

  void init() { options::kRecentCheckpoints.reset(); }

  void startsEmpty() {
    auto w = newWindow();
    QVERIFY(!w->currentModel());
    QVERIFY(!w->modelView()->hasModel());
    QCOMPARE(w->currentPage(), MainWindow::Page::Model);
    QCOMPARE(w->modelView()->headGridModel()->rowCount(), 0);
    QCOMPARE(w->modelStatusText(), QStringLiteral("No model open"));
  }

  void opensCheckpoint_data() {
    QTest::addColumn<int>("layers");
    QTest::addColumn<int>("heads");
    QTest::addColumn<int>("kvHeads");
    QTest::newRow("gqa 2 per group") << 3 << 4 << 2;
    QTest::newRow("gqa 4 per group") << 2 << 8 << 2;
    QTest::newRow("mha") << 2 << 4 << 4;
    QTest::newRow("mqa") << 4 << 6 << 1;
  }
  void opensCheckpoint() {
    QFETCH(int, layers);
    QFETCH(int, heads);
    QFETCH(int, kvHeads);
    TinySpec spec;
    spec.layers = layers;
    spec.heads = heads;
    spec.kv_heads = kvHeads;
    const std::string name = std::string("open-") + QTest::currentDataTag();
    const fs::path dir = checkpoint(name, spec);

    auto w = newWindow();
    QSignalSpy loaded(w.get(), &MainWindow::modelLoaded);
    QSignalSpy failed(w.get(), &MainWindow::loadFailed);
    QVERIFY(w->openCheckpoint(qpath(dir)));
    QCOMPARE(loaded.count(), 1);
    QCOMPARE(failed.count(), 0);
    QVERIFY(w->currentModel());
    QCOMPARE(loaded.first().first().toString(), normalizedCheckpointPath(qpath(dir)));

    // Head grid: L rows, Hq columns, cell (l, h) = KV group h / (Hq / Hkv).
    const HeadGridModel* grid = w->modelView()->headGridModel();
    QCOMPARE(grid->rowCount(), layers);
    QCOMPARE(grid->columnCount(), heads);
    const int group = heads / kvHeads;
    for (int l = 0; l < layers; ++l) {
      for (int h = 0; h < heads; ++h) {
        const QModelIndex cell = grid->index(l, h);
        QCOMPARE(cell.data(Qt::DisplayRole).toInt(), h / group);
        QCOMPARE(cell.data(HeadGridModel::KvGroupRole).toInt(), h / group);
        QCOMPARE(cell.data(HeadGridModel::LayerRole).toInt(), l);
      }
    }
    QCOMPARE(grid->headerData(0, Qt::Horizontal).toString(), QStringLiteral("H0"));
    QCOMPARE(grid->headerData(heads - 1, Qt::Horizontal).toString(), QStringLiteral("H%1").arg(heads - 1));
    QCOMPARE(grid->headerData(layers - 1, Qt::Vertical).toString(), QStringLiteral("L%1").arg(layers - 1));

    // Configuration form.
    const ModelView* view = w->modelView();
    QCOMPARE(view->fieldText("num_hidden_layers"), QString::number(layers));
    QCOMPARE(view->fieldText("num_attention_heads"), QString::number(heads));
    QCOMPARE(view->fieldText("num_key_value_heads"), QString::number(kvHeads));
    QCOMPARE(view->fieldText("head_dim"), QString::number(spec.head_dim));
    QCOMPARE(view->fieldText("hidden_size"), QString::number(spec.hidden));
    QCOMPARE(view->fieldText("vocab_size"), QString::number(spec.vocab));
    QCOMPARE(view->fieldText("intermediate_size"), QString::number(spec.intermediate));
    QVERIFY2(view->fieldText("kv_group_size").startsWith(QString::number(group)), qPrintable(view->fieldText("kv_group_size")));
    QCOMPARE(view->fieldText("rope_theta"), QStringLiteral("1,000,000"));
    QCOMPARE(view->fieldText("rms_norm_eps"), QStringLiteral("1e-06"));
    QCOMPARE(view->fieldText("tie_word_embeddings"), QStringLiteral("yes"));
    QCOMPARE(view->fieldText("dtype"), QStringLiteral("F32"));
    QCOMPARE(view->fieldText("architecture"), QStringLiteral("Qwen3ForCausalLM (qwen3)"));
    const QString params = QString::fromStdString(format_parameter_count(hh::test::tiny_parameter_count(spec)));
    QCOMPARE(view->fieldText("parameters"), params);
    QVERIFY(view->fieldText("parameters_counted").startsWith(params));
    QVERIFY(!view->parameterWarningShown());
    QVERIFY(view->fieldText("fingerprint").startsWith(QStringLiteral("sha256:")));
    QCOMPARE(view->fieldText("fingerprint"), QString::fromStdString(w->currentModel()->fingerprint));
    const auto* shown = view->findChild<QLabel*>(QStringLiteral("field_fingerprint"));
    QVERIFY(shown && shown->text().endsWith(QChar(0x2026)));  // shortened on screen, whole in fieldText()
    QCOMPARE(view->fieldText("files"), QStringLiteral("model.safetensors"));

    // Tensor list.
    const TensorTableModel* tensors = view->tensorModel();
    QCOMPARE(tensors->rowCount(), int(hh::test::tiny_tensors(spec).size()));
    QCOMPARE(tensors->index(0, TensorTableModel::NameColumn).data().toString(), QStringLiteral("model.embed_tokens.weight"));
    QCOMPARE(tensors->index(0, TensorTableModel::DTypeColumn).data().toString(), QStringLiteral("F32"));
    QCOMPARE(tensors->index(0, TensorTableModel::ShapeColumn).data().toString(),
             QStringLiteral("[%1, %2]").arg(spec.vocab).arg(spec.hidden));

    // Status bar and title name the model; the status bar gives the fingerprint prefix.
    const QString status = w->modelStatusText();
    QVERIFY2(status.contains(QString::fromStdString(name)), qPrintable(status));
    QVERIFY2(status.contains(params + " parameters"), qPrintable(status));
    QVERIFY2(status.contains(QString::fromStdString(fingerprint_prefix(w->currentModel()->fingerprint))), qPrintable(status));
    QVERIFY(w->windowTitle().contains(QString::fromStdString(name)));
  }

  void headGridTintsAndTooltips() {
    HeadGridModel grid;
    grid.setShape(/*layers=*/2, /*query_heads=*/8, /*kv_heads=*/4);
    auto tint = [&](int h) { return grid.index(0, h).data(Qt::BackgroundRole).value<QBrush>().color(); };
    QCOMPARE(tint(0), tint(1));     // same group
    QVERIFY(tint(1) != tint(2));    // neighbouring groups differ
    QCOMPARE(tint(0), tint(4));     // hues alternate
    QCOMPARE(grid.index(1, 3).data(Qt::ToolTipRole).toString(),
             QString::fromUtf8("layer 1, head 3, KV group 1 (heads 2\u20133)"));
    grid.setShape(1, 4, 4);
    QCOMPARE(grid.index(0, 2).data(Qt::ToolTipRole).toString(), QStringLiteral("layer 0, head 2, KV group 2 (head 2)"));
    grid.setShape(2, 4, 3);  // Hkv must divide Hq
    QCOMPARE(grid.rowCount(), 0);
  }

  void parameterCountCheck_data() {
    QTest::addColumn<bool>("tied");
    QTest::addColumn<QString>("skip");
    QTest::addColumn<bool>("warning");
    QTest::newRow("tied, complete") << true << QString() << false;
    QTest::newRow("untied, complete") << false << QString() << false;
    QTest::newRow("tensor missing") << true << "model.norm.weight" << true;
  }
  void parameterCountCheck() {
    QFETCH(bool, tied);
    QFETCH(QString, skip);
    QFETCH(bool, warning);
    TinySpec spec;
    spec.tied = tied;
    spec.skip_tensor = skip.toStdString();
    const fs::path dir = checkpoint(std::string("params-") + QTest::currentDataTag(), spec);
    auto w = newWindow();
    QVERIFY(w->openCheckpoint(qpath(dir)));
    QCOMPARE(w->modelView()->parameterWarningShown(), warning);
    QCOMPARE(w->modelView()->fieldText("tie_word_embeddings"), tied ? QStringLiteral("yes") : QStringLiteral("no"));
    if (warning) {
      QVERIFY(w->modelView()->fieldText("parameters_counted").contains(QStringLiteral("differs")));
      QVERIFY(w->modelView()->fieldText("parameters_counted").contains(QStringLiteral("-%1").arg(spec.hidden)));
    }
  }

  void badCheckpointKeepsPreviousModel_data() {
    QTest::addColumn<QString>("setup");
    QTest::addColumn<QString>("expected");  // the message must name this file or field
    QTest::newRow("malformed json") << "malformed" << "config.json";
    QTest::newRow("heads not divisible") << "bad-heads" << "num_key_value_heads";
    QTest::newRow("missing field") << "missing-field" << "hidden_size";
    QTest::newRow("no config.json") << "no-config" << "config.json";
    QTest::newRow("truncated safetensors") << "truncated" << "model.safetensors";
    QTest::newRow("not a folder") << "file" << "not a folder";
    QTest::newRow("missing folder") << "missing" << "no such folder";
  }
  void badCheckpointKeepsPreviousModel() {
    QFETCH(QString, setup);
    QFETCH(QString, expected);
    TinySpec good;
    good.layers = 3;
    const fs::path good_dir = checkpoint("previous", good);
    const fs::path bad = scratchRoot() / ("bad-" + setup.toStdString());
    fs::remove_all(bad);
    if (setup == "file") {
      hh::test::write_text(bad, "{}");
    } else if (setup != "missing") {
      checkpoint(bad.filename().string());
      if (setup == "malformed") hh::test::write_text(bad / "config.json", "{\"vocab_size\": 64, ");
      if (setup == "bad-heads") {
        TinySpec s;
        s.kv_heads = 3;
        hh::test::write_text(bad / "config.json", hh::test::tiny_config_json(s));
      }
      if (setup == "missing-field") {
        std::string text = hh::test::tiny_config_json(TinySpec{});
        const auto at = text.find("  \"hidden_size\"");
        text.erase(at, text.find('\n', at) + 1 - at);
        hh::test::write_text(bad / "config.json", text);
      }
      if (setup == "no-config") fs::remove(bad / "config.json");
      if (setup == "truncated") fs::resize_file(bad / "model.safetensors", 20);
    }

    auto w = newWindow();
    QVERIFY(w->openCheckpoint(qpath(good_dir)));
    const QString status = w->modelStatusText();
    QSignalSpy loaded(w.get(), &MainWindow::modelLoaded);
    QSignalSpy failed(w.get(), &MainWindow::loadFailed);

    QVERIFY(!w->openCheckpoint(qpath(bad)));
    QCOMPARE(failed.count(), 1);
    QCOMPARE(loaded.count(), 0);
    const QString message = failed.first().first().toString();
    QVERIFY2(message.contains(expected), qPrintable(message));

    // The previous model stays open and on display, and the bad folder is not remembered.
    QVERIFY(w->currentModel());
    QCOMPARE(qpath(w->currentModel()->dir), normalizedCheckpointPath(qpath(good_dir)));
    QCOMPARE(w->modelView()->headGridModel()->rowCount(), 3);
    QCOMPARE(w->modelView()->fieldText("num_hidden_layers"), QStringLiteral("3"));
    QCOMPARE(w->modelStatusText(), status);
    QCOMPARE(w->recentCheckpoints(), QStringList{normalizedCheckpointPath(qpath(good_dir))});
  }

  void recentCheckpoints() {
    QStringList dirs;
    for (int i = 0; i < kMaxRecentCheckpoints + 2; ++i)
      dirs << normalizedCheckpointPath(qpath(checkpoint("recent-" + std::to_string(i))));

    auto w = newWindow();
    QVERIFY(w->openCheckpoint(dirs[0]));
    QVERIFY(w->openCheckpoint(dirs[1]));
    QVERIFY(w->openCheckpoint(dirs[0]));
    QCOMPARE(w->recentCheckpoints(), (QStringList{dirs[0], dirs[1]}));
    for (const QString& d : dirs) QVERIFY(w->openCheckpoint(d));
    QStringList expected;
    for (int i = dirs.size() - 1; expected.size() < kMaxRecentCheckpoints; --i) expected << dirs[i];
    QCOMPARE(w->recentCheckpoints(), expected);

    // A folder that disappeared is dropped when the menu is shown, and from the stored list.
    QVERIFY(QDir(expected[2]).removeRecursively());
    w->refreshRecentMenu();
    expected.removeAt(2);
    QCOMPARE(w->recentCheckpoints(), expected);
    QStringList inMenu;
    for (QAction* a : w->recentMenu()->actions())
      if (!a->data().toString().isEmpty()) inMenu << a->data().toString();
    QCOMPARE(inMenu, expected);

    // Another window (a later session) sees the same list; its menu entries open the checkpoint.
    auto later = newWindow();
    QCOMPARE(later->recentCheckpoints(), expected);
    QSignalSpy loaded(later.get(), &MainWindow::modelLoaded);
    QAction* second = nullptr;
    for (QAction* a : later->recentMenu()->actions())
      if (a->data().toString() == expected[1]) second = a;
    QVERIFY(second);
    second->trigger();
    QVERIFY(loaded.wait(5000));
    QCOMPARE(loaded.first().first().toString(), expected[1]);
    QCOMPARE(later->recentCheckpoints().first(), expected[1]);

    later->clearRecentCheckpoints();
    QVERIFY(later->recentCheckpoints().isEmpty());
    const auto actions = later->recentMenu()->actions();
    QVERIFY(std::none_of(actions.begin(), actions.end(), [](QAction* a) { return a->isEnabled() && !a->data().isNull(); }));
  }

  void dropFolder_data() {
    QTest::addColumn<QString>("what");
    QTest::addColumn<bool>("accepted");
    QTest::newRow("folder") << "folder" << true;
    QTest::newRow("config.json") << "config" << true;
    QTest::newRow("safetensors file") << "weights" << true;
    QTest::newRow("unrelated file") << "other" << false;
    QTest::newRow("web url") << "web" << false;
  }
  void dropFolder() {
    QFETCH(QString, what);
    QFETCH(bool, accepted);
    const fs::path dir = checkpoint("dropped");
    hh::test::write_text(dir / "notes.txt", "x");
    QUrl url = QUrl::fromLocalFile(qpath(dir));
    if (what == "config") url = QUrl::fromLocalFile(qpath(dir / "config.json"));
    if (what == "weights") url = QUrl::fromLocalFile(qpath(dir / "model.safetensors"));
    if (what == "other") url = QUrl::fromLocalFile(qpath(dir / "notes.txt"));
    if (what == "web") url = QUrl(QStringLiteral("https://example.org/model"));
    QCOMPARE(checkpointFolderFromDrop({url}).isEmpty(), !accepted);

    DropWindow w;
    w.setInteractive(false);
    QSignalSpy loaded(&w, &MainWindow::modelLoaded);
    QMimeData mime;
    mime.setUrls({url});
    QDragEnterEvent enter(QPoint(10, 10), Qt::CopyAction, &mime, Qt::LeftButton, Qt::NoModifier);
    enter.setAccepted(false);
    w.dragEnterEvent(&enter);
    QCOMPARE(enter.isAccepted(), accepted);
    if (!accepted) return;
    QDropEvent drop(QPointF(10, 10), Qt::CopyAction, &mime, Qt::LeftButton, Qt::NoModifier);
    w.dropEvent(&drop);
    QVERIFY(loaded.wait(5000));
    QCOMPARE(loaded.first().first().toString(), normalizedCheckpointPath(qpath(dir)));
  }

  void navigationPages() {
    auto w = newWindow();
    QListWidget* nav = w->navigation();
    QStringList names;
    for (int i = 0; i < nav->count(); ++i) names << nav->item(i)->text();
    QCOMPARE(names, (QStringList{"Model", "Calibration", "Analysis", "Heads", "Layers", "Runs", "Eval"}));

    w->showPage(MainWindow::Page::Heads);
    QCOMPARE(w->currentPage(), MainWindow::Page::Heads);
    QVERIFY(!w->headsView()->isHidden());  // the current page of the stack

    // Opening a model brings the Model page forward.
    QVERIFY(w->openCheckpoint(qpath(checkpoint("nav"))));
    QCOMPARE(w->currentPage(), MainWindow::Page::Model);
    QCOMPARE(nav->currentRow(), 0);
  }

  // Writes screenshots into $HH_SCREENSHOT_DIR (skipped when unset): the Model page with a
  // Qwen3-0.6B-shaped (28 layers x 16 query heads, 8 KV heads) but tiny model, its Tensors tab, the
  // empty window, the Heads page before an analysis, and a checkpoint whose tensors disagree with its config.
  void screenshots() {
    const QString out = qEnvironmentVariable("HH_SCREENSHOT_DIR");
    if (out.isEmpty()) QSKIP("set HH_SCREENSHOT_DIR to write screenshots");
    QVERIFY(QDir().mkpath(out));
    auto save = [&](QWidget& w, const char* name) {
      QTest::qWait(150);
      QVERIFY(w.grab().save(QDir(out).filePath(QString::fromLatin1(name))));
    };
    TinySpec spec;
    spec.layers = 28;
    spec.heads = 16;
    spec.kv_heads = 8;
    spec.head_dim = 16;
    spec.hidden = 64;
    spec.vocab = 512;
    spec.intermediate = 192;
    spec.dtype = hh::io::DType::BF16;
    const fs::path dir = checkpoint("qwen3-tiny-28x16", spec);

    MainWindow w;
    w.setInteractive(false);
    w.resize(1280, 800);
    w.show();
    QVERIFY(QTest::qWaitForWindowExposed(&w));
    save(w, "workbench-empty.png");
    QVERIFY(w.openCheckpoint(qpath(dir)));
    save(w, "workbench-model.png");
    w.modelView()->tabs()->setCurrentIndex(1);
    save(w, "workbench-tensors.png");
    w.modelView()->tabs()->setCurrentIndex(0);
    w.showPage(MainWindow::Page::Heads);
    save(w, "workbench-heads-empty.png");
    spec.skip_tensor = "model.layers.27.mlp.down_proj.weight";
    QVERIFY(w.openCheckpoint(qpath(checkpoint("qwen3-tiny-missing-tensor", spec))));
    save(w, "workbench-mismatch.png");

    // The error box, as an interactive session shows it: grabbed and closed once it is up.
    const fs::path bad = checkpoint("qwen3-bad-config", spec);
    TinySpec bad_spec = spec;
    bad_spec.kv_heads = 5;
    hh::test::write_text(bad / "config.json", hh::test::tiny_config_json(bad_spec));
    w.setInteractive(true);
    bool grabbed = false;
    QTimer::singleShot(300, &w, [&] {
      if (QWidget* box = QApplication::activeModalWidget()) {
        grabbed = box->grab().save(QDir(out).filePath(QStringLiteral("workbench-error.png")));
        box->close();
      }
    });
    QVERIFY(!w.openCheckpoint(qpath(bad)));
    QVERIFY(grabbed);
  }
};

QTEST_MAIN(TestModelView)
#include "test_model_view.moc"
