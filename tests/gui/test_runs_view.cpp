// The Runs view and the New Run dialog with real jobs: the bundled demo teacher converted at 7:1 and
// trained for a few steps on the CPU by `hydrahead train`, launched, followed, cancelled and resumed
// from the view.
#include <QCoreApplication>
#include <QElapsedTimer>
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
#include <memory>

#include <torch/torch.h>

#include "gui/gui_support.h"
#include "core/jobs/job.h"
#include "core/train/job_lock.h"
#include "core/train/run_log.h"
#include "job_dialog.h"
#include "main_window.h"
#include "qt_util.h"
#include "runs_view.h"

namespace fs = std::filesystem;
using namespace hh::workbench;
using namespace hh::test::gui;

namespace {

fs::path scratchRoot() { return scratch("gui_runs_view"); }

// A QProcess that tells how many connections its stateChanged() has (QObject::receivers is protected).
class WatchedProcess : public QProcess {
 public:
  int stateReceivers() const { return receivers(SIGNAL(stateChanged(QProcess::ProcessState))); }
};

// A failed exit check's message: the job's exit code and the end of its log, which says why.
QString exitAndLog(const QSignalSpy& finished, const QString& log) {
  return QStringLiteral("the job exited with %1; its log ends:\n%2").arg(finished.first().first().toInt()).arg(log.right(3000));
}


void setStages(JobDialog& d, const std::vector<std::array<const char*, 4>>& rows) {
  for (int r = 0; r < static_cast<int>(rows.size()); ++r)
    for (int c = 0; c < 4; ++c) d.stages()->item(r, c + 1)->setText(QString::fromLatin1(rows[static_cast<size_t>(r)][static_cast<size_t>(c)]));
}

}  // namespace

class TestRunsView : public QObject {
  Q_OBJECT

  fs::path manifest_;

  // A job file for the demo teacher: the quick template with these stage sizes.
  QString job(const std::string& name, const std::vector<std::array<const char*, 4>>& stages) {
    JobDialog d;
    d.setTemplate(QStringLiteral("three-stage-quick"));
    d.setTeacher(qpath(demo_model()));
    d.setManifest(qpath(manifest_));
    d.setOutput(qpath(scratchRoot() / name));
    d.setDevice(QStringLiteral("cpu"));
    d.setTaskLength(384);  // variable-tracking needs 317 tokens with this tokenizer
    setStages(d, stages);
    QString error;
    if (!d.writeJob(&error)) qWarning("%s", qPrintable(error));
    return d.jobFile();
  }

 private Q_SLOTS:
  void initTestCase() {
    fresh_scratch("gui_runs_view");
    manifest_ = scratchRoot() / "manifest.json";
    QProcess p;
    p.setProcessChannelMode(QProcess::MergedChannels);
    p.start(program("hydrahead"), {"select", "--model", qpath(demo_model()), "--strategy", "random", "--ratio", "7", "--seed", "1",
                          "--out", qpath(manifest_)});
    QVERIFY(p.waitForFinished(60000));
    QVERIFY2(p.exitCode() == 0, p.readAll().constData());
  }

  void dialogWritesASpecTheCoreAccepts() {
    const QString file = job("dialog", {{"3", "0.002", "288", "2"}, {"4", "0.0005", "288", "1"}, {"2", "0.0001", "544", "1"}});
    const auto spec = hh::jobs::JobSpec::load(file.toStdString());
    QCOMPARE(spec.stages.size(), size_t{3});
    QCOMPARE(spec.stages[0].steps, int64_t{3});
    QCOMPARE(spec.stages[0].batch, int64_t{2});
    QCOMPARE(spec.stages[1].lr, 0.0005);
    QCOMPARE(spec.stages[2].seq_len, int64_t{544});
    QCOMPARE(QString::fromStdString(spec.teacher.string()), qpath(demo_model()));
    QCOMPARE(spec.device, std::string("cpu"));
    QCOMPARE(spec.data.size(), size_t{4});  // the built-in task mix
    QVERIFY(spec.stages[0].warmup < spec.stages[0].steps);

    JobDialog bad;
    bad.setTeacher(qpath(demo_model()));
    bad.setManifest(qpath(manifest_));
    bad.setOutput(qpath(scratchRoot() / "bad"));
    bad.stages()->item(1, 1)->setText(QStringLiteral("many"));
    QString error;
    QVERIFY(!bad.writeJob(&error));
    QVERIFY2(error.contains(QStringLiteral("distil")), qPrintable(error));
    QVERIFY(!QFileInfo::exists(bad.jobFile()));
  }

  // The three-stage template asks for cuda (and bf16): where this build or machine has none, the dialog
  // offers cpu only and the spec says cpu with the checkpoint's dtype; where it has CUDA, the template's
  // cuda and bf16 stand.
  void cudaIsOfferedOnlyWhereItIs() {
    JobDialog d;
    d.setTemplate(QStringLiteral("three-stage"));
    d.setTeacher(qpath(demo_model()));
    d.setManifest(qpath(manifest_));
    d.setOutput(qpath(scratchRoot() / "cuda-offer"));
    QString error;
    const QString text = d.jobJson(&error);
    QVERIFY2(!text.isEmpty(), qPrintable(error));
    const auto j = nlohmann::json::parse(text.toStdString());
    if (torch::cuda::is_available()) {
      QCOMPARE(j.at("device").get<std::string>(), std::string("cuda"));
      QCOMPARE(j.at("dtype").get<std::string>(), std::string("bf16"));
    } else {
      QCOMPARE(j.at("device").get<std::string>(), std::string("cpu"));
      QVERIFY(!j.contains("dtype"));
      d.setDevice(QStringLiteral("cuda"));  // not offered: the choice stays
      QCOMPARE(nlohmann::json::parse(d.jobJson(&error).toStdString()).at("device").get<std::string>(), std::string("cpu"));
    }
  }

  void launchFollowsTheJobToTheEnd() {
    MainWindow w;
    w.setInteractive(false);
    RunsView* v = w.runsView();
    v->setProgram(program("hydrahead"));
    const QString file = job("full", {{"4", "0.002", "288", "1"}, {"3", "0.0005", "288", "1"}, {"2", "0.0001", "288", "1"}});
    QSignalSpy progressed(v, &RunsView::progressed);
    QSignalSpy finished(v, &RunsView::finished);
    QString error;
    QVERIFY2(v->launch(file, &error), qPrintable(error));
    QCOMPARE(v->state(), RunsView::State::Running);
    QVERIFY(!v->launch(file, &error));  // one job at a time
    QVERIFY(finished.wait(300000));
    QVERIFY2(finished.first().first().toInt() == 0, qPrintable(exitAndLog(finished, v->logText())));
    QCOMPARE(v->state(), RunsView::State::Done);
    QCOMPARE(progressed.count(), 9);  // one event a step
    QCOMPARE(progressed.last().at(0).toInt(), 9);
    QCOMPARE(v->totalSteps(), 9);
    QCOMPARE(v->curvePoints(), 9);
    QVERIFY(v->logText().contains(QStringLiteral("done:")));
    const auto run = hh::train::read_run(scratchRoot() / "full" / "run.h5");
    QCOMPARE(v->lastLoss(), run.loss.back());
    QVERIFY(!run.eval_loss.empty());
    QCOMPARE(v->evalPoints(), static_cast<int>(run.eval_loss.size()));  // each held-out loss a point
    QVERIFY(fs::exists(scratchRoot() / "full" / "model" / "config.json"));

    // Another view (a later session) lists the run and opens it from its directory.
    RunsView other;
    QVERIFY(other.runs().contains(qpath(scratchRoot() / "full")));
    QVERIFY(other.openRun(qpath(scratchRoot() / "full"), &error));
    QCOMPARE(other.curvePoints(), 9);
    QCOMPARE(other.globalStep(), 9);
    QCOMPARE(other.state(), RunsView::State::Done);
    QVERIFY2(other.statusText().contains(QStringLiteral("finished: 9 steps in ")), qPrintable(other.statusText()));
    // The log lists each stage as `train --status` does.
    const auto align = hh::train::summarize_stage(run, 0);
    QVERIFY2(other.logText().contains(QStringLiteral("align: 4 of 4 steps, loss %1, held out %2")
                                          .arg(QString::number(align.loss, 'g', 4), QString::number(align.eval_loss, 'g', 4))),
             qPrintable(other.logText()));
    QVERIFY(!other.openRun(qpath(scratchRoot()), &error));
    QVERIFY(error.contains(QStringLiteral("no run.h5")));
  }

  // A job started elsewhere (`hydrahead train` in a terminal): the view that opens its directory
  // follows it while it runs, sees it stop on Ctrl-C, and follows its rerun to the end.
  void followsAJobOfAnotherProcess() {
    const QString file = job("elsewhere", {{"60", "0.002", "288", "1"}, {"2", "0.0005", "288", "1"}, {"2", "0.0001", "288", "1"}});
    const QString dir = qpath(scratchRoot() / "elsewhere");
    const fs::path run = scratchRoot() / "elsewhere" / "run.h5";
    auto rows = [&run] {
      try {
        return fs::exists(run) ? static_cast<int>(hh::train::read_run(run).step.size()) : 0;
      } catch (const std::exception&) {
        return 0;  // being created
      }
    };
    QProcess job;
    job.setProcessChannelMode(QProcess::MergedChannels);
    const QStringList args{QStringLiteral("train"), QStringLiteral("--job"), file, QStringLiteral("--progress"),
                           QStringLiteral("none")};
    job.start(program("hydrahead"), args);
    QVERIFY(job.waitForStarted());
    QTRY_VERIFY_WITH_TIMEOUT(rows() > 0, 120000);

    MainWindow w;
    w.setInteractive(false);
    QVERIFY(w.openRun(dir));
    QCOMPARE(w.currentPage(), MainWindow::Page::Runs);
    RunsView* v = w.runsView();
    QCOMPARE(v->state(), RunsView::State::Following);
    QVERIFY2(v->statusText().contains(QStringLiteral("running: stage align, step ")), qPrintable(v->statusText()));
    QCOMPARE(v->totalSteps(), 64);
    QSignalSpy progressed(v, &RunsView::progressed);
    QVERIFY(progressed.wait(60000));  // a tick that saw new steps
    QVERIFY(progressed.last().at(0).toInt() > 0);
    QCOMPARE(progressed.last().at(1).toInt(), 64);

    // Cancel in the view asks the job to stop as Ctrl-C does (it runs on this host and names its
    // process): it checkpoints and exits 130, and the view sees it stopped where its file ends.
    QVERIFY2(v->logText().contains(QStringLiteral("its job runs in process %1 on ").arg(job.processId())), qPrintable(v->logText()));
    v->cancel();
    QVERIFY(job.waitForFinished(120000));
    QVERIFY2(job.exitCode() == 130, job.readAll().constData());
    QTRY_COMPARE_WITH_TIMEOUT(v->state(), RunsView::State::Stopped, 10000);
    const int stopped_at = rows();
    QVERIFY(stopped_at < 64);
    QCOMPARE(v->globalStep(), stopped_at);
    QCOMPARE(v->curvePoints(), stopped_at);
    QVERIFY2(v->statusText().contains(QStringLiteral("stopped at step %1 of 64").arg(stopped_at)), qPrintable(v->statusText()));
    QVERIFY2(v->logText().contains(QStringLiteral("its job has ended")), qPrintable(v->logText()));

    // The same job again continues from its checkpoint; opened while it runs, followed to its end.
    job.start(program("hydrahead"), args);
    QVERIFY(job.waitForStarted());
    QTRY_VERIFY_WITH_TIMEOUT(hh::train::job_running(scratchRoot() / "elsewhere"), 60000);
    QString error;
    QVERIFY2(v->openRun(dir, &error), qPrintable(error));
    QCOMPARE(v->state(), RunsView::State::Following);
    QVERIFY(job.waitForFinished(300000));
    QVERIFY2(job.exitCode() == 0, job.readAll().constData());
    QTRY_COMPARE_WITH_TIMEOUT(v->state(), RunsView::State::Done, 10000);
    QCOMPARE(v->globalStep(), 64);
    QCOMPARE(v->curvePoints(), 64);
    QVERIFY2(v->statusText().contains(QStringLiteral("finished: 64 steps in ")), qPrintable(v->statusText()));

    // A folder that is not a run is refused by name.
    QSignalSpy failed(&w, &MainWindow::loadFailed);
    QVERIFY(!w.openRun(qpath(scratchRoot())));
    QCOMPARE(failed.count(), 1);
    QVERIFY(failed.first().first().toString().contains(QStringLiteral("no run.h5")));
  }

  void cancelCheckpointsAndResumeFinishes() {
    RunsView v;
    v.setProgram(program("hydrahead"));
    const QString file = job("cancel", {{"40", "0.002", "288", "1"}, {"2", "0.0005", "288", "1"}, {"2", "0.0001", "288", "1"}});
    QSignalSpy progressed(&v, &RunsView::progressed);
    QSignalSpy finished(&v, &RunsView::finished);
    QString error;
    QVERIFY(v.launch(file, &error));
    QVERIFY(progressed.wait(120000));
    v.cancel();
    QVERIFY(finished.wait(120000));
    QVERIFY2(finished.first().first().toInt() == 130, qPrintable(exitAndLog(finished, v.logText())));
    QCOMPARE(v.state(), RunsView::State::Interrupted);
    QVERIFY(fs::exists(scratchRoot() / "cancel" / "checkpoints" / "LATEST"));
    const int stopped_at = v.globalStep();
    QVERIFY(stopped_at < 44);

    finished.clear();
    QVERIFY(v.resume(&error));
    QVERIFY(finished.wait(300000));
    QVERIFY2(finished.first().first().toInt() == 0, qPrintable(exitAndLog(finished, v.logText())));
    QCOMPARE(v.state(), RunsView::State::Done);
    QCOMPARE(v.globalStep(), 44);
    QVERIFY(v.logText().contains(QStringLiteral("resumed")));
    QCOMPARE(v.curvePoints(), 44);  // one trajectory: the rows after the checkpoint were replaced
  }

  // Closing the view while its job will not stop on SIGINT: the view waits its three seconds, then the job
  // is killed, and the view goes without a crash (the job's end must not reach a view half destroyed).
  void closingWhileAJobIgnoresSigintKillsIt() {
    const fs::path stubborn = scratchRoot() / "ignores-sigint.sh";
    QVERIFY(write_script(stubborn, "#!/bin/sh\ntrap '' INT\nexec sleep 60\n"));
    const QString file = job("stubborn", {{"2", "0.002", "288", "1"}, {"2", "0.0005", "288", "1"}, {"2", "0.0001", "288", "1"}});
    qint64 pid = 0;
    QElapsedTimer closing;
    {
      auto v = std::make_unique<RunsView>();
      v->setProgram(qpath(stubborn));
      QString error;
      QVERIFY2(v->launch(file, &error), qPrintable(error));
      const auto procs = v->findChildren<QProcess*>();
      QCOMPARE(procs.size(), qsizetype{1});
      QVERIFY(procs.first()->waitForStarted(10000));
      pid = procs.first()->processId();
      QVERIFY(pid > 0);
      QTest::qWait(300);  // the script has set its trap
      closing.start();
    }
    QVERIFY2(closing.elapsed() < 20000, qPrintable(QString::number(closing.elapsed())));
    QVERIFY(closing.elapsed() >= 2900);  // it waited for the job to stop first
    QCOMPARE(::kill(static_cast<pid_t>(pid), 0), -1);  // gone (and reaped)
    QCOMPARE(errno, ESRCH);
  }

  // interruptChild on a child still starting does not wait for it: the SIGINT goes when it runs, asked
  // for once however often it is called, and nothing stays connected after. A start that fails uses the
  // request up, so a later start of the same QProcess is not interrupted.
  void interruptingAStartingChildDoesNotWait() {
    WatchedProcess child;
    const int before = child.stateReceivers();
    child.start(QStringLiteral("sleep"), {QStringLiteral("60")});
    QCOMPARE(child.state(), QProcess::Starting);  // its start is reported through the event loop
    QVERIFY(interruptChild(child));
    QVERIFY(interruptChild(child));
    QCOMPARE(child.state(), QProcess::Starting);  // not waited for
    QCOMPARE(child.stateReceivers(), before + 1);
    QVERIFY(child.waitForFinished(30000));        // sleep 60 ended by the SIGINT sent once it ran
    QCOMPARE(child.exitStatus(), QProcess::CrashExit);
    QCOMPARE(child.exitCode(), SIGINT);
    QCOMPARE(child.stateReceivers(), before);

    WatchedProcess reused;
    reused.start(qpath(scratchRoot() / "no-such-program"), {});
    QCOMPARE(reused.state(), QProcess::Starting);
    QVERIFY(interruptChild(reused));
    QVERIFY(!reused.waitForStarted(10000));
    QCOMPARE(reused.error(), QProcess::FailedToStart);
    QCOMPARE(reused.stateReceivers(), before);
    reused.start(QStringLiteral("sleep"), {QStringLiteral("1")});
    QVERIFY(reused.waitForFinished(30000));
    QCOMPARE(reused.exitStatus(), QProcess::NormalExit);
    QCOMPARE(reused.exitCode(), 0);
  }

  void aFailingJobLeavesTheViewStanding() {
    RunsView v;
    QSignalSpy finished(&v, &RunsView::finished);
    QString error;
    v.setProgram(QStringLiteral("/nonexistent/hydrahead"));
    const QString file = job("fail", {{"2", "0.002", "288", "1"}, {"2", "0.0005", "288", "1"}, {"2", "0.0001", "288", "1"}});
    QVERIFY(v.launch(file, &error));
    QVERIFY(finished.count() == 1 || finished.wait(10000));
    QCOMPARE(v.state(), RunsView::State::Failed);
    QVERIFY(v.logText().contains(QStringLiteral("could not start")));

    // The dialog refuses a teacher that does not exist, naming it.
    JobDialog missing;
    missing.setTeacher(qpath(scratchRoot() / "no-such-teacher"));
    missing.setManifest(qpath(manifest_));
    missing.setOutput(qpath(scratchRoot() / "fail-missing"));
    QVERIFY(!missing.writeJob(&error));
    QVERIFY2(error.contains(QStringLiteral("no-such-teacher")), qPrintable(error));

    // A job that fails inside (a manifest for another model) exits 1 with its error in the log.
    finished.clear();
    v.setProgram(program("hydrahead"));
    QFile in(qpath(manifest_));
    QVERIFY(in.open(QIODevice::ReadOnly));
    QByteArray text = in.readAll();
    text.replace("\"num_layers\": 6", "\"num_layers\": 7");
    QVERIFY(text.contains("\"num_layers\": 7"));
    const fs::path other = scratchRoot() / "other-model-manifest.json";
    QFile out(qpath(other));
    QVERIFY(out.open(QIODevice::WriteOnly));
    out.write(text);
    out.close();
    JobDialog d;
    d.setTeacher(qpath(demo_model()));
    d.setManifest(qpath(other));
    d.setOutput(qpath(scratchRoot() / "fail2"));
    setStages(d, {{"2", "0.002", "288", "1"}, {"2", "0.0005", "288", "1"}, {"2", "0.0001", "288", "1"}});
    QVERIFY(d.writeJob(&error));
    QVERIFY(v.launch(d.jobFile(), &error));
    QVERIFY(finished.wait(60000));
    QCOMPARE(finished.first().first().toInt(), 1);
    QCOMPARE(v.state(), RunsView::State::Failed);
    QVERIFY2(v.logText().contains(QStringLiteral("other-model-manifest.json")), qPrintable(v.logText()));
  }
};

QTEST_MAIN(TestRunsView)
#include "test_runs_view.moc"
