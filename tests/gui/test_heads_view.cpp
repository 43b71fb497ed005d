// The Heads view on a real analysis: the bundled demo teacher, a small NIAH calibration set and
// `hydrahead analyze`, all run here. The heatmap must show the file's numbers, clicks must toggle heads
// (with undo), bad files must be refused by name, and the app's --screenshot must render something.
#include <QCoreApplication>
#include <QImage>
#include <QProcess>
#include <QSet>
#include <QSettings>
#include <QSlider>
#include <QSignalSpy>
#include <QStandardPaths>
#include <QTableWidget>
#include <QUndoStack>
#include <QtTest>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include "gui/gui_support.h"
#include "qcustomplot_include.h"

#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include "core/interp/similarity.h"
#include "core/interp/calibration.h"
#include "core/interp/patching.h"
#include "core/io/h5.h"
#include "core/model/tokenizer.h"
#include "core/select/manifest.h"
#include "core/select/selection.h"
#include "head_selection.h"
#include "heads_view.h"
#include "layers_view.h"
#include "selection_panel.h"
#include "main_window.h"

namespace fs = std::filesystem;
using namespace hh::workbench;
using namespace hh::test::gui;

namespace {

fs::path scratchRoot() { return scratch("gui_heads_view"); }


std::unique_ptr<MainWindow> newWindow() {
  auto w = std::make_unique<MainWindow>();
  w->setInteractive(false);
  w->resize(1200, 800);
  w->show();
  QCoreApplication::processEvents();
  return w;
}

}  // namespace

class TestHeadsView : public QObject {
  Q_OBJECT

  fs::path analysis_, heads_only_;

 private Q_SLOTS:
  void initTestCase() {
    fresh_scratch("gui_heads_view");
    QVERIFY2(fs::exists(demo_model() / "config.json"), "the bundled demo model is missing");
    const fs::path calib = scratchRoot() / "calib.jsonl";
    analysis_ = scratchRoot() / "analysis.h5";
    QVERIFY(run_hydrahead({"tasks", "generate", "--model", qpath(demo_model()), "--task", "niah-single", "--n", "3", "--length",
                     "256", "--param", "random_depth=true", "--seed", "3", "--out", qpath(calib)}));
    QVERIFY(run_hydrahead({"analyze", "--model", qpath(demo_model()), "--calib", qpath(calib), "--method",
                     "activation,path,retrieval,similarity", "--dtype", "f32", "--out", qpath(analysis_)}));
    heads_only_ = scratchRoot() / "heads-only.h5";
    QVERIFY(run_hydrahead({"analyze", "--model", qpath(demo_model()), "--calib", qpath(calib), "--method", "retrieval",
                     "--dtype", "f32", "--out", qpath(heads_only_)}));
  }

  void showsTheFileValuesOnASymmetricScale() {
    auto w = newWindow();
    QSignalSpy loaded(w.get(), &MainWindow::analysisLoaded);
    QVERIFY(w->openAnalysis(qpath(analysis_)));
    QCOMPARE(loaded.count(), 1);
    QCOMPARE(w->currentPage(), MainWindow::Page::Heads);
    HeadsView* v = w->headsView();
    QCOMPARE(v->layers(), 6);
    QCOMPARE(v->queryHeads(), 8);
    QCOMPARE(v->kvGroupSize(), 4);
    for (const char* name : {"noising", "path", "retrieval_score", "retrieval_noising", "composite"})
      QVERIFY2(v->signalNames().contains(QLatin1String(name)), name);
    QCOMPARE(v->currentSignal(), QStringLiteral("composite"));

    const auto file = hh::io::H5File::open_read(analysis_);
    for (const auto& [signal, dataset] : {std::pair<QString, std::string>{"noising", "/activation/noising/effect"},
                                          {"path", "/path/effect"},
                                          {"retrieval_score", "/retrieval/score"}}) {
      v->setSignal(signal);
      QCOMPARE(v->currentSignal(), signal);
      const at::Tensor want = file.read(dataset).to(at::kDouble);
      double lim = 0;
      for (int l = 0; l < 6; ++l)
        for (int h = 0; h < 8; ++h) {
          const double x = want[l][h].item<double>();
          QCOMPARE(v->value(l, h), x);
          QCOMPARE(v->colorMap()->data()->cell(h, l), x);
          lim = std::max(lim, std::abs(x));
        }
      QCOMPARE(v->colorMap()->dataRange().upper, lim);
      QCOMPARE(v->colorMap()->dataRange().lower, -lim);
    }
    // The demo teacher's retrieval heads (layer 3, KV group 1) lead the retrieval-score ranking.
    v->setSignal(QStringLiteral("retrieval_score"));
    for (int h = 4; h < 8; ++h) QVERIFY2(v->rank(3, h) <= 4, qPrintable(v->tooltipFor(3, h)));
  }

  void clickTogglesAHeadWithUndo() {
    auto w = newWindow();
    QVERIFY(w->openAnalysis(qpath(analysis_)));
    HeadsView* v = w->headsView();
    HeadSelection* sel = w->selection();
    v->plot()->replot();
    const std::vector<HeadRef> start = sel->sorted();  // the default strategy, applied on open
    QCOMPARE(start.size(), size_t{6});
    QVERIFY(!sel->isFullAttention(3, 5) || !sel->isFullAttention(0, 1));
    const HeadRef a = sel->isFullAttention(3, 5) ? HeadRef{0, 1} : HeadRef{3, 5};  // a head outside the set
    const HeadRef b = start.front();                                                // one inside it
    const int steps = sel->undoStack()->count();
    QSignalSpy changed(sel, &HeadSelection::changed);
    QSignalSpy clicked(v, &HeadsView::headClicked);

    int l = -1, h = -1;
    QVERIFY(v->cellAt(v->cellCenter(a.first, a.second), &l, &h));
    QCOMPARE(std::make_pair(l, h), a);
    QTest::mouseClick(v->plot(), Qt::LeftButton, {}, v->cellCenter(a.first, a.second));
    QCOMPARE(clicked.count(), 1);
    QCOMPARE(changed.count(), 1);
    QVERIFY(sel->isFullAttention(a.first, a.second));
    QCOMPARE(v->outlinedHeads(), 7);
    QCOMPARE(v->detailHead(), a);
    QCOMPARE(v->detailTable()->rowCount(), static_cast<int>(v->signalNames().size()));
    const QString where = QStringLiteral("layer %1, head %2 (KV group %3)").arg(a.first).arg(a.second).arg(a.second / 4);
    QVERIFY2(v->tooltipFor(a.first, a.second).contains(where), qPrintable(v->tooltipFor(a.first, a.second)));
    QVERIFY(v->tooltipFor(a.first, a.second).contains(QStringLiteral("full attention")));
    QVERIFY(v->selectionPanel()->countText().contains(QStringLiteral("7 of 48")));
    QVERIFY(v->selectionPanel()->countText().contains(QStringLiteral("by hand")));

    QTest::mouseClick(v->plot(), Qt::LeftButton, {}, v->cellCenter(b.first, b.second));  // to linear
    QVERIFY(!sel->isFullAttention(b.first, b.second));
    QCOMPARE(v->outlinedHeads(), 6);
    QCOMPARE(sel->undoStack()->count(), steps + 2);
    sel->undoStack()->undo();
    QVERIFY(sel->isFullAttention(b.first, b.second));
    sel->undoStack()->undo();
    QCOMPARE(sel->sorted(), start);
    QVERIFY(v->selectionPanel()->countText().contains(QStringLiteral("global")));
    sel->undoStack()->redo();
    QVERIFY(sel->isFullAttention(a.first, a.second));
    // A click outside the grid changes nothing.
    const int before = changed.count();
    QTest::mouseClick(v->plot(), Qt::LeftButton, {}, QPoint(2, 2));
    QCOMPARE(changed.count(), before);
  }

  void detailShowsTheHeadsAttentionOnAnExample() {
    auto w = newWindow();
    QVERIFY(w->openAnalysis(qpath(analysis_)));
    HeadsView* v = w->headsView();
    v->plot()->replot();
    QTest::mouseClick(v->plot(), Qt::LeftButton, {}, v->cellCenter(3, 4));  // a retrieval head
    QCOMPARE(v->attentionShape(), std::make_pair(0, 0));  // no forward pass until asked for
    QString error;
    QSignalSpy shown(v, &HeadsView::attentionShown);
    QVERIFY2(v->showAttention(1, &error), qPrintable(error));
    // The model loads and the forward runs on a worker thread: the window keeps handling events.
    QVERIFY(v->attentionBusy());
    QVERIFY(v->attentionText().startsWith(QStringLiteral("Computing head 3:4 on example 1")));
    QTRY_VERIFY_WITH_TIMEOUT(!v->attentionBusy() && shown.count() == 1, 120000);
    const auto [A, T] = v->attentionShape();
    // Example 1 of the calibration set, as the core reads it: the needle holds what the head reads.
    const auto tok = hh::model::Tokenizer::load(demo_model() / "tokenizer.json");
    const auto examples = hh::interp::read_calibration(scratchRoot() / "calib.jsonl", &tok, tok.vocab_size());
    const auto& ex = examples[1];
    QCOMPARE(A, static_cast<int>(ex.answer_ids.size()));
    QCOMPARE(T, static_cast<int>(ex.clean_ids.size() + ex.answer_ids.size() - 1));
    const auto spans = hh::interp::needle_spans(ex);
    QVERIFY(!spans.empty());
    const auto& rows = v->attentionRows();
    for (int i = 0; i < A; ++i) {
      double sum = 0;
      int best = 0;
      for (int t = 0; t < T; ++t) {
        const double x = rows[static_cast<size_t>(i * T + t)];
        sum += x;
        if (x > rows[static_cast<size_t>(i * T + best)]) best = t;
      }
      QVERIFY(std::abs(sum - 1.0) < 1e-6);
      bool inside = false;
      for (const auto& [b, e] : spans) inside = inside || (best >= b && best < e);
      QVERIFY2(inside, qPrintable(QStringLiteral("row %1 peaks at %2").arg(i).arg(best)));
    }
    QVERIFY(v->attentionText().contains(QStringLiteral("Head 3:4 on example 1")));
    QTest::mouseClick(v->plot(), Qt::LeftButton, {}, v->cellCenter(2, 1));  // now each click follows
    QTRY_VERIFY_WITH_TIMEOUT(v->attentionText().contains(QStringLiteral("Head 2:1 on example 1")), 120000);
    QTRY_VERIFY_WITH_TIMEOUT(!v->attentionBusy(), 120000);
    // Clicks faster than the forward: only the last one is shown.
    QTest::mouseClick(v->plot(), Qt::LeftButton, {}, v->cellCenter(1, 0));
    QTest::mouseClick(v->plot(), Qt::LeftButton, {}, v->cellCenter(0, 2));
    QTRY_VERIFY_WITH_TIMEOUT(!v->attentionBusy(), 120000);
    QVERIFY2(v->attentionText().contains(QStringLiteral("Head 0:2 on example 1")), qPrintable(v->attentionText()));
    // An example outside the set (read by now) is refused at once.
    QVERIFY(!v->showAttention(99, &error));
    QVERIFY(error.contains(QStringLiteral("not in the calibration set")));
  }

  void openingAnotherFileCancelsOnlyTheRunningRequest() {
    auto w = newWindow();
    QVERIFY(w->openAnalysis(qpath(analysis_)));
    HeadsView* v = w->headsView();
    v->plot()->replot();
    QTest::mouseClick(v->plot(), Qt::LeftButton, {}, v->cellCenter(3, 4));
    QString error;
    QVERIFY2(v->showAttention(1, &error), qPrintable(error));
    QVERIFY(v->attentionBusy());
    // Reopening moves to a new file: the running request is told to stop, and its result is dropped.
    QVERIFY(w->openAnalysis(qpath(analysis_)));
    QCOMPARE(v->attentionShape(), std::make_pair(0, 0));
    // A request for the file now open runs to the end: the stop was for the old request only.
    v->plot()->replot();
    QTest::mouseClick(v->plot(), Qt::LeftButton, {}, v->cellCenter(2, 1));
    QVERIFY2(v->showAttention(0, &error), qPrintable(error));
    QTRY_VERIFY_WITH_TIMEOUT(!v->attentionBusy(), 120000);
    QVERIFY2(v->attentionText().contains(QStringLiteral("Head 2:1 on example 0")), qPrintable(v->attentionText()));
    QVERIFY(v->attentionShape().first > 0);
  }

  void ratioDragIsOneStepAndStrategiesFollowTheCore() {
    auto w = newWindow();
    QVERIFY(w->openAnalysis(qpath(analysis_)));
    HeadSelection* sel = w->selection();
    SelectionPanel* p = w->headsView()->selectionPanel();
    const auto* signals = w->headsView()->analysisSignals();
    QVERIFY(signals);
    const int steps = sel->undoStack()->count();
    QSlider* slider = p->ratioSlider();
    slider->setSliderDown(true);
    for (int r : {6, 5, 4, 3, 2}) slider->setValue(r);  // a drag: previews only
    QCOMPARE(sel->count(), 6);
    QCOMPARE(sel->undoStack()->count(), steps);
    slider->setSliderDown(false);  // release: one step
    QCOMPARE(sel->undoStack()->count(), steps + 1);
    QCOMPARE(sel->count(), static_cast<int>(hh::select::fa_count(signals->shape, 2)));  // round(48 / 3) = 16
    QCOMPARE(sel->count(), 16);

    // Every strategy gives the core's heads for the same inputs.
    const auto weights = hh::select::default_weights();
    const auto comp = hh::select::composite(*signals, weights);
    for (const char* strategy : {"per-layer", "kv-group", "layerwise", "random", "global"}) {
      p->setStrategy(QString::fromLatin1(strategy));
      hh::select::SelectOptions o;
      o.strategy = strategy;
      o.ratio = 2;
      const auto want = hh::select::select_heads(signals->shape, comp.score, o);
      std::vector<HeadRef> heads;
      for (const auto& [l, h] : want) heads.push_back({static_cast<int>(l), static_cast<int>(h)});
      QCOMPARE(sel->sorted(), heads);
      QVERIFY2(p->applyError().isEmpty(), qPrintable(p->applyError()));
    }
    QCOMPARE(p->budgetTable()->rowCount(), 12);  // 3 contexts x (dense, layer-wise, random, this selection)
    w->selection()->undoStack()->undo();
    QCOMPARE(p->strategy(), QStringLiteral("global"));  // the controls keep their values; the heads go back
    QCOMPARE(sel->count(), 16);
  }

  // In a 1200 x 800 window the budget table shows one context's four rows (dense, layer-wise, random, this
  // selection) whole, without scrolling, beside the panel's other parts.
  void budgetTableShowsAContextsRowsWhole() {
    auto w = newWindow();
    QVERIFY(w->openAnalysis(qpath(analysis_)));
    w->showPage(MainWindow::Page::Heads);
    QVERIFY(QTest::qWaitForWindowExposed(w.get()));
    QCoreApplication::processEvents();
    QTableWidget* t = w->headsView()->selectionPanel()->budgetTable();
    QVERIFY(t->isVisible());
    QVERIFY(t->rowCount() >= 4);
    const QRect last = t->visualRect(t->model()->index(3, 0));
    QVERIFY2(last.top() >= 0 && last.bottom() < t->viewport()->height(),
             qPrintable(QStringLiteral("row 3 at %1..%2, viewport %3 high").arg(last.top()).arg(last.bottom()).arg(t->viewport()->height())));
  }

  void exportedManifestEqualsTheClis() {
    auto w = newWindow();
    QVERIFY(w->openAnalysis(qpath(analysis_)));
    SelectionPanel* p = w->headsView()->selectionPanel();
    auto strip = [](const fs::path& f) {
      nlohmann::json j = nlohmann::json::parse(std::ifstream(f));
      j.erase("created");
      j.erase("created_by");
      return j;
    };
    struct Case {
      QString strategy;
      int ratio, seed, min_per_layer;
      QStringList cli;
    };
    const std::vector<Case> cases = {
        {"global", 7, 0, 0, {"--strategy", "global", "--ratio", "7"}},
        {"per-layer", 3, 0, 0, {"--strategy", "per-layer", "--ratio", "3"}},
        {"random", 5, 11, 0, {"--strategy", "random", "--ratio", "5", "--seed", "11"}},
        {"global", 4, 0, 1, {"--strategy", "global", "--ratio", "4", "--min-per-layer", "1"}},
    };
    int i = 0;
    for (const Case& c : cases) {
      p->setStrategy(c.strategy);
      p->setRatio(c.ratio);
      p->setSeed(c.seed);
      p->setMinPerLayer(c.min_per_layer);
      const fs::path gui = scratchRoot() / ("gui-" + std::to_string(i) + ".json");
      const fs::path cli = scratchRoot() / ("cli-" + std::to_string(i++) + ".json");
      QVERIFY(w->exportManifest(qpath(gui)));
      QVERIFY(run_hydrahead(QStringList{"select", "--analysis", qpath(analysis_), "--compare", "--out", qpath(cli)} + c.cli));
      QCOMPARE(QString::fromStdString(strip(gui).dump(1)), QString::fromStdString(strip(cli).dump(1)));
      p->setMinPerLayer(0);
    }
    // Hand edits export as a manual selection, as `select --strategy manual --heads ...` writes it.
    p->setStrategy(QStringLiteral("global"));
    p->setRatio(7);
    w->selection()->toggle(5, 0);
    QString heads;
    for (const auto& [l, h] : w->selection()->sorted()) heads += QStringLiteral("%1%2:%3").arg(heads.isEmpty() ? "" : ",").arg(l).arg(h);
    const fs::path gui = scratchRoot() / "gui-manual.json", cli = scratchRoot() / "cli-manual.json";
    QVERIFY(w->exportManifest(qpath(gui)));
    QVERIFY(run_hydrahead({"select", "--analysis", qpath(analysis_), "--compare", "--strategy", "manual", "--heads", heads,
                     "--ratio", "7", "--out", qpath(cli)}));
    QCOMPARE(QString::fromStdString(strip(gui).dump(1)), QString::fromStdString(strip(cli).dump(1)));
    // An unwritable place is an error naming it, not a crash or a partial file.
    QSignalSpy failed(w.get(), &MainWindow::loadFailed);
    QVERIFY(!w->exportManifest(QStringLiteral("/nonexistent-dir/m.json")));
    QCOMPARE(failed.count(), 1);
    QVERIFY(failed.first().first().toString().contains(QStringLiteral("/nonexistent-dir/m.json")));
  }

  void importsTheManifestSelectWrites() {
    auto w = newWindow();
    QVERIFY(w->openAnalysis(qpath(analysis_)));
    const fs::path manifest = scratchRoot() / "manifest.json";
    QVERIFY(run_hydrahead({"select", "--analysis", qpath(analysis_), "--ratio", "7", "--out", qpath(manifest)}));
    const auto m = hh::select::read_manifest(manifest);
    std::vector<HeadRef> want;
    for (const auto& [l, h] : m.fa_heads) want.push_back({static_cast<int>(l), static_cast<int>(h)});
    QCOMPARE(want.size(), size_t{6});
    w->headsView()->selectionPanel()->setStrategy(QStringLiteral("layerwise"));
    const std::vector<HeadRef> before = w->selection()->sorted();
    QVERIFY(before != want);
    QVERIFY(w->importManifest(qpath(manifest)));
    QCOMPARE(w->selection()->sorted(), want);
    QCOMPARE(w->headsView()->outlinedHeads(), 6);
    w->selection()->undoStack()->undo();  // the import is one step
    QCOMPARE(w->selection()->sorted(), before);

    // A manifest for another grid is refused by name and changes nothing.
    nlohmann::json j = nlohmann::json::parse(std::ifstream(manifest));
    j["model"]["num_layers"] = 7;
    j.erase("fa_heads");
    j["fa_heads"] = nlohmann::json::array({{6, 0}});
    const fs::path other = scratchRoot() / "other-model.json";
    std::ofstream(other) << j.dump();
    QSignalSpy failed(w.get(), &MainWindow::loadFailed);
    QVERIFY(!w->importManifest(qpath(other)));
    QCOMPARE(failed.count(), 1);
    QVERIFY2(failed.first().first().toString().contains(QStringLiteral("other-model.json")),
             qPrintable(failed.first().first().toString()));
    QCOMPARE(w->selection()->sorted(), before);
  }

  void layersViewShowsSimilarityAndTheCoresBlocks() {
    auto w = newWindow();
    QVERIFY(w->openAnalysis(qpath(analysis_)));
    LayersView* v = w->layersView();
    QCOMPARE(v->metrics(), (QStringList{"cosine_delta", "cka", "angular"}));
    QCOMPARE(v->currentMetric(), QStringLiteral("cka"));
    QCOMPARE(v->layers(), 6);
    const auto file = hh::io::H5File::open_read(analysis_);
    for (const char* metric : {"cosine_delta", "cka", "angular"}) {
      v->setMetric(QString::fromLatin1(metric));
      const at::Tensor m = file.read(std::string("/similarity/") + metric).to(at::kDouble);
      for (int i = 0; i < 6; ++i)
        for (int j = 0; j < 6; ++j) {
          QCOMPARE(v->value(i, j), m[i][j].item<double>());
          QCOMPARE(v->colorMap()->data()->cell(j, i), m[i][j].item<double>());
        }
      for (double t : {0.5, 0.8, 0.95}) {
        v->setThreshold(t);
        std::vector<std::pair<int, int>> want;
        for (const auto& [a, b] : hh::interp::similarity_blocks(m, t, std::string(metric) == "angular"))
          want.push_back({static_cast<int>(a), static_cast<int>(b)});
        QCOMPARE(v->blocks(), want);
        QVERIFY(v->noteText().contains(v->blocksText()));
      }
    }
    // Blocks tile the layers in order.
    v->setMetric(QStringLiteral("cka"));
    v->setThreshold(0.9);
    int next = 0;
    for (const auto& [a, b] : v->blocks()) {
      QCOMPARE(a, next);
      QVERIFY(b >= a);
      next = b + 1;
    }
    QCOMPARE(next, 6);

    // A file without similarity opens (its heads are fine) and says what is missing.
    QVERIFY(w->openAnalysis(qpath(heads_only_)));
    QVERIFY(v->metrics().isEmpty());
    QVERIFY(v->noteText().contains(QStringLiteral("no layer similarity")));
    QVERIFY(w->headsView()->signalNames().contains(QStringLiteral("retrieval_score")));
  }

  void refusesAFileThatIsNotAnAnalysis() {
    auto w = newWindow();
    QVERIFY(w->openAnalysis(qpath(analysis_)));
    const fs::path bad = scratchRoot() / "not-an-analysis.h5";
    std::ofstream(bad) << "plain text";
    QSignalSpy failed(w.get(), &MainWindow::loadFailed);
    QVERIFY(!w->openAnalysis(qpath(bad)));
    QCOMPARE(failed.count(), 1);
    QVERIFY2(failed.first().first().toString().contains(QStringLiteral("not-an-analysis.h5")),
             qPrintable(failed.first().first().toString()));
    QCOMPARE(w->headsView()->analysisPath(), qpath(fs::absolute(analysis_)));  // the previous file stays
    QTRY_VERIFY(w->logText().contains(QStringLiteral("not-an-analysis.h5")));  // and the log panel has it
  }

  void screenshotRendersTheWindow() {
    const fs::path png = scratchRoot() / "heads.png";
    QString out;
    QVERIFY(run_program(program("hydrahead-workbench"),
                {"--model", qpath(demo_model()), "--analysis", qpath(analysis_), "--screenshot", qpath(png)}, &out));
    QImage image(qpath(png));
    QVERIFY(!image.isNull());
    QVERIFY(image.width() > 400 && image.height() > 300);
    QSet<QRgb> colours;
    for (int y = 0; y < image.height(); y += 3)
      for (int x = 0; x < image.width(); x += 3) colours.insert(image.pixel(x, y));
    QVERIFY2(colours.size() > 50, qPrintable(QString::number(colours.size())));
    // And a failure to open is an exit status, not a silent picture.
    QVERIFY(!run_program(program("hydrahead-workbench"),
                 {"--analysis", qpath(scratchRoot() / "missing.h5"), "--screenshot", qpath(png)}));
  }
};

QTEST_MAIN(TestHeadsView)
#include "test_heads_view.moc"
