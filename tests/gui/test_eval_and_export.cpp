// The Eval view on files `hydrahead eval` writes (and on the two-model layout of `hydrahead demo`),
// and exporting plots (PNG, SVG, PDF) and tables (CSV).
#include <QCoreApplication>
#include <QFile>
#include <QImage>
#include <QProcess>
#include <QSettings>
#include <QSignalSpy>
#include <QStandardPaths>
#include <QTableWidget>
#include <QtTest>
#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>

#include <torch/torch.h>

#include "gui/gui_support.h"
#include "core/io/h5.h"
#include "eval_view.h"
#include "export.h"
#include "qcustomplot_include.h"

namespace fs = std::filesystem;
using namespace hh::workbench;
using namespace hh::test::gui;

namespace {

fs::path scratchRoot() { return scratch("gui_eval_export"); }


QByteArray head(const fs::path& f, int n) {
  QFile in(qpath(f));
  return in.open(QIODevice::ReadOnly) ? in.read(n) : QByteArray();
}

}  // namespace

class TestEvalAndExport : public QObject {
  Q_OBJECT

  fs::path niah_, ppl_;

 private Q_SLOTS:
  void initTestCase() {
    fresh_scratch("gui_eval_export");
    niah_ = scratchRoot() / "niah.h5";
    ppl_ = scratchRoot() / "ppl.h5";
    QVERIFY(run_hydrahead({"eval", "--model", qpath(demo_model()), "--task", "niah-grid", "--lengths", "512,1024", "--depths",
                 "0,0.5,1", "--n", "2", "--out", qpath(niah_)}));
    std::ofstream(scratchRoot() / "text.jsonl") << R"({"text": "The water comes in and goes out twice a day, more or less."})" << "\n";
    QVERIFY(run_hydrahead({"eval", "--model", qpath(demo_model()), "--task", "ppl", "--data", qpath(scratchRoot() / "text.jsonl"),
                 "--seq", "64", "--out", qpath(ppl_)}));
  }

  void showsTheGridsAndPerplexities() {
    EvalView v;
    QString error;
    QVERIFY2(v.openFile(qpath(niah_), EvalView::Teacher, &error), qPrintable(error));
    const auto f = hh::io::H5File::open_read(niah_);
    const at::Tensor acc = f.read("/niah/accuracy").to(at::kDouble);
    QVERIFY(v.grid(EvalView::Teacher).has_value());
    const NiahGrid& g = *v.grid(EvalView::Teacher);
    QCOMPARE(g.lengths, (std::vector<int64_t>{512, 1024}));
    QCOMPARE(g.depths, (std::vector<double>{0, 0.5, 1}));
    for (int i = 0; i < 2; ++i)
      for (int j = 0; j < 3; ++j) {
        QCOMPARE(g.accuracy[static_cast<size_t>(i * 3 + j)], acc[i][j].item<double>());
        auto* map = qobject_cast<QCPColorMap*>(v.plot(EvalView::Teacher)->plottable(0));
        QVERIFY(map);
        QCOMPARE(map->data()->cell(j, i), acc[i][j].item<double>());
      }
    QVERIFY(!v.perplexity(EvalView::Teacher).has_value());
    QVERIFY(v.openFile(qpath(ppl_), EvalView::Teacher, &error));  // adds the perplexity, keeps the grid
    QCOMPARE(*v.perplexity(EvalView::Teacher), hh::io::H5File::open_read(ppl_).read("/ppl/ppl").to(at::kDouble)[0].item<double>());
    QVERIFY(v.grid(EvalView::Teacher).has_value());
    QVERIFY(!v.grid(EvalView::Hybrid).has_value());

    // The two-model layout of `hydrahead demo` fills both sides.
    const fs::path both = scratchRoot() / "both.h5";
    {
      auto out = hh::io::H5File::create(both);
      for (const char* who : {"teacher", "hybrid"}) {
        const std::string g0 = std::string("/") + who;
        out.create_group(g0);
        out.create_group(g0 + "/niah");
        out.create_group(g0 + "/ppl");
        out.write(g0 + "/niah/accuracy", std::string(who) == "teacher" ? torch::ones({1, 2}, torch::kDouble)
                                                                        : torch::tensor({{0.25, 0.75}}, torch::kDouble));
        out.write(g0 + "/niah/lengths", torch::tensor({512}, torch::kLong));
        out.write(g0 + "/niah/depths", torch::tensor({0.0, 1.0}, torch::kDouble));
        out.write(g0 + "/ppl/ppl", torch::tensor({std::string(who) == "teacher" ? 3.0 : 4.5}, torch::kDouble));
      }
      out.commit();
    }
    EvalView v2;
    QVERIFY2(v2.openFile(qpath(both), EvalView::Teacher, &error), qPrintable(error));
    QCOMPARE(v2.grid(EvalView::Hybrid)->accuracy, (std::vector<double>{0.25, 0.75}));
    QCOMPARE(v2.grid(EvalView::Teacher)->mean(), 1.0);
    QCOMPARE(*v2.perplexity(EvalView::Hybrid), 4.5);
    QVERIFY(v2.summaryText().contains(QStringLiteral("hybrid: NIAH 0.500, perplexity 4.50")));

    // Not an eval file: refused by name, nothing changes.
    const fs::path other = scratchRoot() / "other.h5";
    {
      auto out = hh::io::H5File::create(other);
      out.write("/x", torch::zeros({1}));
      out.commit();
    }
    QVERIFY(!v2.openFile(qpath(other), EvalView::Hybrid, &error));
    QVERIFY2(error.contains(QStringLiteral("other.h5")), qPrintable(error));
    QCOMPARE(*v2.perplexity(EvalView::Hybrid), 4.5);
  }

  void evaluatesAModelInTheBackground() {
    EvalView v;
    v.setProgram(program("hydrahead"));
    QSignalSpy evaluated(&v, &EvalView::evaluated);
    QSignalSpy failed(&v, &EvalView::failed);
    QSignalSpy progressed(&v, &EvalView::progressed);
    QString error;
    QCOMPARE(v.device(), QStringLiteral("cpu"));
    QVERIFY(!v.setDevice(QStringLiteral("tpu")));
    QVERIFY(!v.evaluate(qpath(scratchRoot()), EvalView::Hybrid, QStringLiteral("512"), 1, &error));
    QVERIFY(error.contains(QStringLiteral("config.json")));
    QVERIFY2(v.evaluate(qpath(demo_model()), EvalView::Hybrid, QStringLiteral("512,640"), 1, &error), qPrintable(error));
    QVERIFY(v.isEvaluating());
    QVERIFY(evaluated.wait(120000));
    // One progress event a prompt: 2 lengths x 5 depths x 1.
    QCOMPARE(progressed.count(), 10);
    for (int i = 0; i < 10; ++i) {
      QCOMPARE(progressed.at(i).at(0).toInt(), i + 1);
      QCOMPARE(progressed.at(i).at(1).toInt(), 10);
    }
    QCOMPARE(evaluated.first().first().toInt(), static_cast<int>(EvalView::Hybrid));
    QCOMPARE(v.grid(EvalView::Hybrid)->lengths, (std::vector<int64_t>{512, 640}));
    QCOMPARE(v.grid(EvalView::Hybrid)->depths.size(), size_t{5});
    QVERIFY(!v.grid(EvalView::Teacher).has_value());
    // A bad length list is the child's error, shown and signalled.
    QVERIFY(v.evaluate(qpath(demo_model()), EvalView::Teacher, QStringLiteral("abc"), 1, &error));
    QVERIFY(failed.wait(60000));
    QVERIFY2(failed.first().first().toString().contains(QStringLiteral("abc")), qPrintable(failed.first().first().toString()));
  }

  // Cancel: the child stops at its next prompt and writes nothing; the view says so and can evaluate again.
  void cancelStopsTheEvaluation() {
    EvalView v;
    v.setProgram(program("hydrahead"));
    QSignalSpy progressed(&v, &EvalView::progressed);
    QSignalSpy failed(&v, &EvalView::failed);
    QSignalSpy evaluated(&v, &EvalView::evaluated);
    QString error;
    QVERIFY2(v.evaluate(qpath(demo_model()), EvalView::Teacher, QStringLiteral("512,1024,2048"), 20, &error), qPrintable(error));
    QVERIFY(progressed.wait(120000));
    QVERIFY2(v.summaryLine().contains(QStringLiteral("of 300 prompts")), qPrintable(v.summaryLine()));
    v.cancel();
    QVERIFY(failed.wait(60000));
    QVERIFY2(failed.first().first().toString().contains(QStringLiteral("cancelled; nothing was written")),
             qPrintable(failed.first().first().toString()));
    QCOMPARE(evaluated.count(), 0);
    QVERIFY(!v.isEvaluating());
    QVERIFY(progressed.count() < 300);
    QVERIFY(!v.grid(EvalView::Teacher).has_value());

    // Cancelled at once, while the child starts or loads the model (before it listens for SIGINT): the
    // same message, nothing opened.
    failed.clear();
    QVERIFY2(v.evaluate(qpath(demo_model()), EvalView::Hybrid, QStringLiteral("512"), 5, &error), qPrintable(error));
    v.cancel();
    QVERIFY(failed.count() == 1 || failed.wait(60000));
    QVERIFY2(failed.first().first().toString().contains(QStringLiteral("cancelled; nothing was written")),
             qPrintable(failed.first().first().toString()));
    QVERIFY(!v.grid(EvalView::Hybrid).has_value());
    QCOMPARE(evaluated.count(), 0);
  }

  // Closing the view during an evaluation kills it, and the view goes without a crash (the evaluation's
  // end must not reach a view half destroyed).
  void closingWhileEvaluatingKillsTheEvaluation() {
    const fs::path slow = scratchRoot() / "slow-eval.sh";
    QVERIFY(write_script(slow, "#!/bin/sh\nexec sleep 60\n"));
    qint64 pid = 0;
    {
      auto v = std::make_unique<EvalView>();
      v->setProgram(qpath(slow));
      QString error;
      QVERIFY2(v->evaluate(qpath(demo_model()), EvalView::Hybrid, QStringLiteral("512"), 1, &error), qPrintable(error));
      const auto procs = v->findChildren<QProcess*>();
      QCOMPARE(procs.size(), qsizetype{1});
      QVERIFY(procs.first()->waitForStarted(10000));
      pid = procs.first()->processId();
      QVERIFY(pid > 0);
    }
    QCOMPARE(::kill(static_cast<pid_t>(pid), 0), -1);  // gone (and reaped)
    QCOMPARE(errno, ESRCH);
  }

  void exportsPlotsAndTables() {
    EvalView v;
    v.resize(900, 500);
    v.show();
    QString error;
    QVERIFY(v.openFile(qpath(niah_), EvalView::Teacher, &error));
    QCustomPlot* plot = v.plot(EvalView::Teacher);
    QVERIFY(exportPlot(plot, qpath(scratchRoot() / "grid.png"), &error));
    QVERIFY(!QImage(qpath(scratchRoot() / "grid.png")).isNull());
    QVERIFY(exportPlot(plot, qpath(scratchRoot() / "grid.svg"), &error));
    QVERIFY(head(scratchRoot() / "grid.svg", 400).contains("<svg"));
    QVERIFY(exportPlot(plot, qpath(scratchRoot() / "grid.pdf"), &error));
    QVERIFY(head(scratchRoot() / "grid.pdf", 5).startsWith("%PDF"));
    QVERIFY(!exportPlot(plot, qpath(scratchRoot() / "grid.bmp"), &error));
    QVERIFY(error.contains(QStringLiteral(".png, .svg or .pdf")));
    QVERIFY(!exportPlot(plot, QStringLiteral("/nonexistent-dir/grid.png"), &error));
    QVERIFY(!fs::exists(scratchRoot() / "grid.png.tmp-export.png"));

    QTableWidget t(2, 2);
    t.setHorizontalHeaderLabels({QStringLiteral("name"), QStringLiteral("value")});
    t.setItem(0, 0, new QTableWidgetItem(QStringLiteral("plain")));
    t.setItem(0, 1, new QTableWidgetItem(QStringLiteral("1.5")));
    t.setItem(1, 0, new QTableWidgetItem(QStringLiteral("a, \"quoted\" one")));
    const fs::path csv = scratchRoot() / "t.csv";
    QVERIFY(exportTableCsv(&t, qpath(csv), &error));
    QFile in(qpath(csv));
    QVERIFY(in.open(QIODevice::ReadOnly));
    QCOMPARE(QString::fromUtf8(in.readAll()),
             QStringLiteral("name,value\nplain,1.5\n\"a, \"\"quoted\"\" one\",\n"));
  }
};

QTEST_MAIN(TestEvalAndExport)
#include "test_eval_and_export.moc"
