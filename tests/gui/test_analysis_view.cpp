// The Analysis view runs the real analysis of the bundled demo teacher in a worker thread: the window
// keeps processing events (progress arrives while it runs), the result fills the Heads map with the
// file's numbers, a cancel writes nothing, and --demo renders a filled map.
#include <QCoreApplication>
#include <QImage>
#include <QProcess>
#include <QSettings>
#include <QSignalSpy>
#include <QStandardPaths>
#include <QtTest>
#include <cstdlib>
#include <filesystem>

#include <torch/torch.h>

#include "gui/gui_support.h"
#include "analysis_view.h"
#include "core/io/h5.h"
#include "heads_view.h"
#include "main_window.h"

namespace fs = std::filesystem;
using namespace hh::workbench;
using namespace hh::test::gui;

namespace {

fs::path scratchRoot() { return scratch("gui_analysis_view"); }

}  // namespace

class TestAnalysisView : public QObject {
  Q_OBJECT

 private Q_SLOTS:
  void initTestCase() {
    fresh_scratch("gui_analysis_view");
    qputenv("HH_DEMO_MODEL", QByteArray::fromStdString(demo_model().string()));
  }

  void runsInTheBackgroundAndFillsTheHeadsMap() {
    MainWindow w;
    w.setInteractive(false);
    QVERIFY(w.openCheckpoint(qpath(demo_model())));
    AnalysisView* v = w.analysisView();
    QCOMPARE(v->modelDir(), QFileInfo(qpath(demo_model())).absoluteFilePath());
    QString error;
    QVERIFY2(v->generateCalibration(qpath(scratchRoot() / "run"), 2, 384, &error), qPrintable(error));
    v->setMethods({QStringLiteral("activation"), QStringLiteral("retrieval")});
    const fs::path out = scratchRoot() / "run" / "analysis.h5";
    v->setOutput(qpath(out));
    QSignalSpy progressed(v, &AnalysisView::progressed);
    QSignalSpy loaded(&w, &MainWindow::analysisLoaded);
    QVERIFY2(v->start(&error), qPrintable(error));
    QVERIFY(v->isRunning());
    QVERIFY(!v->start(&error));  // one at a time
    QVERIFY(loaded.wait(180000));
    QVERIFY(progressed.count() > 1);  // delivered while the worker ran
    QVERIFY(progressed.last().first().toDouble() > 0.99);
    QCOMPARE(w.currentPage(), MainWindow::Page::Heads);
    HeadsView* h = w.headsView();
    h->setSignal(QStringLiteral("noising"));
    const at::Tensor effect = hh::io::H5File::open_read(out).read("/activation/noising/effect").to(at::kDouble);
    for (int l = 0; l < 6; ++l)
      for (int hh = 0; hh < 8; ++hh) QCOMPARE(h->value(l, hh), effect[l][hh].item<double>());
    QVERIFY(v->logText().contains(QStringLiteral("wrote")));
  }

  void cancelWritesNothing() {
    MainWindow w;
    w.setInteractive(false);
    QVERIFY(w.openCheckpoint(qpath(demo_model())));
    AnalysisView* v = w.analysisView();
    QString error;
    QVERIFY(v->generateCalibration(qpath(scratchRoot() / "cancel"), 6, 512, &error));
    const fs::path out = scratchRoot() / "cancel" / "analysis.h5";
    v->setOutput(qpath(out));
    QSignalSpy failed(v, &AnalysisView::analysisFailed);
    QSignalSpy progressed(v, &AnalysisView::progressed);
    QVERIFY(v->start(&error));
    QVERIFY(progressed.wait(120000));
    v->cancel();
    QVERIFY(failed.wait(120000));
    QVERIFY(failed.first().first().toString().contains(QStringLiteral("cancelled")));
    QVERIFY(!fs::exists(out));
    QVERIFY(!v->isRunning());
    // Missing inputs are refused before anything runs.
    AnalysisView bare;
    QVERIFY(!bare.start(&error));
    QVERIFY(error.contains(QStringLiteral("model")));
  }

  void demoScreenshotShowsTheAnalysedModel() {
    const fs::path png = scratchRoot() / "demo.png";
    QProcess p;
    p.setProcessChannelMode(QProcess::MergedChannels);
    p.start(program("hydrahead-workbench"), {"--demo", "--screenshot", qpath(png)});
    QVERIFY(p.waitForFinished(300000));
    QVERIFY2(p.exitCode() == 0, p.readAll().constData());
    QImage image(qpath(png));
    QVERIFY(!image.isNull());
    QSet<QRgb> colours;
    for (int y = 0; y < image.height(); y += 3)
      for (int x = 0; x < image.width(); x += 3) colours.insert(image.pixel(x, y));
    QVERIFY2(colours.size() > 50, qPrintable(QString::number(colours.size())));
  }
};

QTEST_MAIN(TestAnalysisView)
#include "test_analysis_view.moc"
