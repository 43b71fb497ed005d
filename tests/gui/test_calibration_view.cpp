// The Calibration view with the bundled demo teacher's tokenizer: generating a set from a plugin's
// parameter form in the background, reading it back through the core reader, showing the needle and
// the answer, refusing a broken file by line, and handing the set to the Analysis view.
#include <QCoreApplication>
#include <QFile>
#include <QSettings>
#include <QLineEdit>
#include <QPushButton>
#include <QSignalSpy>
#include <QStandardPaths>
#include <QTextBrowser>
#include <QtTest>
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include <torch/torch.h>

#include "gui/gui_support.h"
#include "analysis_view.h"
#include "calibration_view.h"
#include "core/interp/calibration.h"
#include "core/model/tokenizer.h"
#include "main_window.h"

namespace fs = std::filesystem;
using namespace hh::workbench;
using namespace hh::test::gui;

namespace {

fs::path scratchRoot() { return scratch("gui_calibration_view"); }

}  // namespace

class TestCalibrationView : public QObject {
  Q_OBJECT

 private Q_SLOTS:
  void initTestCase() {
    fresh_scratch("gui_calibration_view");
  }

  void generatesFromTheFormAndShowsTheNeedle() {
    MainWindow w;
    w.setInteractive(false);
    QVERIFY(w.openCheckpoint(qpath(demo_model())));
    CalibrationView* v = w.calibrationView();
    QVERIFY(v->taskIds().contains(QStringLiteral("niah-single")));
    QVERIFY(v->taskIds().contains(QStringLiteral("variable-tracking")));
    v->setTask(QStringLiteral("niah-single"));
    QVERIFY(v->setParam(QStringLiteral("length"), QStringLiteral("300")));
    QVERIFY(v->setParam(QStringLiteral("random_depth"), QStringLiteral("true")));
    QVERIFY(v->setParam(QStringLiteral("haystack"), QStringLiteral("noise")));
    QVERIFY(!v->setParam(QStringLiteral("no_such_param"), QStringLiteral("1")));
    v->setCount(5);
    v->setSeed(9);
    const fs::path out = scratchRoot() / "niah.jsonl";
    QSignalSpy generated(v, &CalibrationView::generated);
    QString error;
    QVERIFY2(v->generate(qpath(out), &error), qPrintable(error));
    QVERIFY(generated.wait(60000));
    QCOMPARE(v->exampleCount(), 5);

    // The file is what the core reader reads, with the form's parameters.
    const auto tok = hh::model::Tokenizer::load(demo_model() / "tokenizer.json");
    const auto examples = hh::interp::read_calibration(out, &tok, tok.vocab_size());
    QCOMPARE(examples.size(), size_t{5});
    for (const auto& ex : examples) {
      QCOMPARE(ex.clean_ids.size(), size_t{300});
      QCOMPARE(ex.meta.at("source").at("params").at("haystack").get<std::string>(), std::string("noise"));
      QVERIFY(ex.meta.at("source").at("params").at("random_depth").get<bool>());
    }
    // The needle is marked and holds the answer; the answer follows the prompt, marked too.
    for (int i = 0; i < 5; ++i) {
      const QString html = v->exampleHtml(i);
      const QString answer = QString::fromStdString(tok.decode(examples[static_cast<size_t>(i)].answer_ids)).trimmed();
      const int needle = html.indexOf(QStringLiteral("title='needle'>"));
      QVERIFY2(needle >= 0, qPrintable(html.left(200)));
      const int needle_end = html.indexOf(QStringLiteral("</span>"), needle);
      QVERIFY2(html.mid(needle, needle_end - needle).contains(answer), qPrintable(answer));
      QVERIFY(html.indexOf(QStringLiteral("title='answer'>")) > needle_end);
    }
    v->showExample(2);
    QVERIFY(v->browser()->toPlainText().contains(QStringLiteral("niah-single")));

    // "Use for Analysis" hands the file over to the Analysis view.
    QPushButton* use = nullptr;
    for (QPushButton* b : v->findChildren<QPushButton*>())
      if (b->text() == QStringLiteral("Use for Analysis")) use = b;
    QVERIFY(use && use->isEnabled());
    QTest::mouseClick(use, Qt::LeftButton);
    QCOMPARE(w.currentPage(), MainWindow::Page::Analysis);
    QVERIFY(w.analysisView()->findChild<QLineEdit*>() != nullptr);
    bool handed = false;
    for (QLineEdit* e : w.analysisView()->findChildren<QLineEdit*>()) handed = handed || e->text() == v->file();
    QVERIFY(handed);
  }

  void refusesABrokenFileByLine() {
    CalibrationView v;
    v.setModelDir(qpath(demo_model()));
    const fs::path bad = scratchRoot() / "bad.jsonl";
    std::ofstream(bad) << R"({"task":"t","clean_ids":[1,2],"corrupt_ids":[1,3],"answer_ids":[4]})" << "\n"
                       << R"({"task":"t","clean_ids":[1,2],"corrupt_ids":[1],"answer_ids":[4]})" << "\n";
    QString error;
    QVERIFY(!v.load(qpath(bad), &error));
    QVERIFY2(error.contains(QStringLiteral("bad.jsonl:2")), qPrintable(error));
    QCOMPARE(v.exampleCount(), 0);
    // Without a tokenizer nothing is generated.
    CalibrationView bare;
    QVERIFY(!bare.generate(qpath(scratchRoot() / "x.jsonl"), &error));
    QVERIFY(error.contains(QStringLiteral("tokenizer")));
  }
};

QTEST_MAIN(TestCalibrationView)
#include "test_calibration_view.moc"
