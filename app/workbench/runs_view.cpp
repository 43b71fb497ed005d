#include "runs_view.h"

#include <torch/torch.h>

#include <QCoreApplication>
#include <QDir>
#include <QFile>
#include <QFileDialog>
#include <QFileInfo>
#include <QHBoxLayout>
#include <QJsonObject>
#include <QLabel>
#include <QListWidget>
#include <QPlainTextEdit>
#include <QProgressBar>
#include <QPushButton>
#include <QSplitter>
#include <QTimer>
#include <QVBoxLayout>
#include <cmath>
#include <csignal>
#include <optional>

#include "core/jobs/job.h"
#include "core/train/job_lock.h"
#include "core/train/run_log.h"
#include "export.h"
#include "job_dialog.h"
#include "qcustomplot_include.h"
#include "settings.h"
#include "qt_util.h"

namespace hh::workbench {

namespace {

constexpr int kLogLines = 400;
const QColor kStageColours[] = {QColor(31, 119, 180), QColor(255, 127, 14), QColor(44, 160, 44), QColor(214, 39, 40),
                                QColor(148, 103, 189), QColor(140, 86, 75)};

}  // namespace

RunsView::RunsView(QWidget* parent) : QWidget(parent) {
  program_ = QCoreApplication::applicationDirPath() + QStringLiteral("/hydrahead");
  runs_list_ = new QListWidget(this);
  runs_list_->setObjectName(QStringLiteral("runsList"));
  new_button_ = new QPushButton(tr("New Run\u2026"), this);
  open_button_ = new QPushButton(tr("Open Run\u2026"), this);
  cancel_button_ = new QPushButton(tr("Cancel"), this);
  resume_button_ = new QPushButton(tr("Resume"), this);
  cancel_button_->setEnabled(false);
  resume_button_->setEnabled(false);
  cancel_button_->setToolTip(tr("Stop the job: it writes a checkpoint first, and Resume continues from it"));
  status_ = new QLabel(tr("No run. New Run\u2026 launches `hydrahead train` on a job; Open Run\u2026 shows one."), this);
  status_->setWordWrap(true);
  progress_ = new QProgressBar(this);
  progress_->setRange(0, 1);
  progress_->setValue(0);

  plot_ = new QCustomPlot(this);
  plot_->setObjectName(QStringLiteral("lossPlot"));
  plot_->xAxis->setLabel(tr("step"));
  plot_->yAxis->setLabel(tr("loss"));
  plot_->yAxis->setScaleType(QCPAxis::stLogarithmic);
  plot_->yAxis->setTicker(QSharedPointer<QCPAxisTickerLog>(new QCPAxisTickerLog));
  plot_->legend->setVisible(true);
  plot_->setMinimumHeight(240);
  addExportMenu(plot_);
  log_ = new QPlainTextEdit(this);
  log_->setObjectName(QStringLiteral("runLog"));
  log_->setReadOnly(true);
  log_->setMaximumBlockCount(kLogLines);
  log_->setFont(QFontDatabase::systemFont(QFontDatabase::FixedFont));

  auto* buttons = new QHBoxLayout;
  buttons->addWidget(new_button_);
  buttons->addWidget(open_button_);
  buttons->addStretch(1);
  buttons->addWidget(cancel_button_);
  buttons->addWidget(resume_button_);
  auto* left = new QWidget(this);
  auto* left_layout = new QVBoxLayout(left);
  left_layout->setContentsMargins(0, 0, 0, 0);
  left_layout->addWidget(new QLabel(tr("Runs"), left));
  left_layout->addWidget(runs_list_);
  auto* right = new QWidget(this);
  auto* right_layout = new QVBoxLayout(right);
  right_layout->setContentsMargins(0, 0, 0, 0);
  right_layout->addLayout(buttons);
  right_layout->addWidget(status_);
  right_layout->addWidget(progress_);
  right_layout->addWidget(plot_, 3);
  right_layout->addWidget(log_, 1);
  auto* split = new QSplitter(this);
  split->addWidget(left);
  split->addWidget(right);
  split->setStretchFactor(1, 4);
  auto* layout = new QVBoxLayout(this);
  layout->addWidget(split);

  poll_ = new QTimer(this);
  poll_->setInterval(1000);
  connect(poll_, &QTimer::timeout, this, &RunsView::refreshCurves);
  connect(cancel_button_, &QPushButton::clicked, this, &RunsView::cancel);
  connect(resume_button_, &QPushButton::clicked, this, [this] {
    QString error;
    if (!resume(&error)) appendLog(tr("cannot resume: %1").arg(error));
  });
  connect(new_button_, &QPushButton::clicked, this, [this] {
    JobDialog dialog(this);
    if (dialog.exec() != QDialog::Accepted) return;
    QString error;
    if (!launch(dialog.jobFile(), &error)) appendLog(tr("cannot start: %1").arg(error));
  });
  connect(open_button_, &QPushButton::clicked, this, [this] {
    const QString dir = QFileDialog::getExistingDirectory(this, tr("Open Run Directory"));
    QString error;
    if (!dir.isEmpty() && !openRun(dir, &error)) appendLog(error);
  });
  // Runs of earlier sessions whose directories still exist.
  for (const QString& dir : options::kRecentRuns.get())
    if (QFileInfo::exists(dir)) runs_list_->addItem(dir);
  connect(runs_list_, &QListWidget::itemActivated, this, [this](QListWidgetItem* item) {
    QString error;
    if (!openRun(item->text(), &error)) appendLog(error);
  });
}

RunsView::~RunsView() {
  if (proc_ && proc_->state() != QProcess::NotRunning) {
    // The window is closing: stop the job cleanly (it checkpoints), but do not wait for long.
    if (interruptChild(*proc_)) proc_->waitForFinished(3000);
  }
  // A job still running now is killed by QProcess's destructor, which runs among this widget's children,
  // after its other children (the poll timer) are gone: its finished() must not reach this view.
  if (proc_) proc_->disconnect(this);
}

QString RunsView::stateText() const {
  switch (state_) {
    case State::Idle: return tr("idle");
    case State::Running: return tr("running");
    case State::Following: return tr("running in another process (followed through its run.h5)");
    case State::Done: return tr("done");
    case State::Stopped: return tr("stopped (its job, run again, continues from the latest checkpoint)");
    case State::Interrupted: return tr("interrupted (Resume continues from its last checkpoint)");
    case State::Failed: return tr("failed");
  }
  return {};
}

bool RunsView::launch(const QString& job_file, QString* error) {
  if (state_ == State::Running) {
    if (error) *error = tr("a job is running; cancel it first");
    return false;
  }
  QString out_dir;
  try {
    const auto spec = jobs::JobSpec::load(toPath(job_file));
    out_dir = QString::fromStdString(std::filesystem::absolute(spec.output).lexically_normal().string());
  } catch (const std::exception& e) {
    if (error) *error = QString::fromStdString(e.what());
    return false;
  }
  job_file_ = QFileInfo(job_file).absoluteFilePath();
  run_dir_ = out_dir;
  addRun(run_dir_);
  delete proc_;
  proc_ = new QProcess(this);
  proc_->setProcessChannelMode(QProcess::MergedChannels);
  connect(proc_, &QProcess::readyReadStandardOutput, this, &RunsView::onOutput);
  connect(proc_, &QProcess::finished, this, &RunsView::onFinished);
  connect(proc_, &QProcess::errorOccurred, this, [this](QProcess::ProcessError e) {
    if (e == QProcess::FailedToStart) {
      appendLog(tr("could not start %1: %2").arg(program_, proc_->errorString()));
      setState(State::Failed);
      Q_EMIT finished(-1);
    }
  });
  global_step_ = 0;
  total_steps_ = 0;
  pending_.clear();
  appendLog(tr("$ %1 train --job %2 --progress json").arg(program_, job_file_));
  setState(State::Running);
  proc_->start(program_, {QStringLiteral("train"), QStringLiteral("--job"), job_file_, QStringLiteral("--progress"),
                          QStringLiteral("json")});
  poll_->start();
  return true;
}

void RunsView::cancel() {
  if (state_ == State::Following) {
    std::string why;
    if (train::interrupt_job(toPath(run_dir_), &why))
      appendLog(tr("asked its job to stop: it writes a checkpoint, then exits"));
    else
      appendLog(tr("cannot stop it: %1").arg(QString::fromStdString(why)));
    return;
  }
  if (!proc_ || proc_->state() == QProcess::NotRunning) return;
  appendLog(tr("cancelling: the job writes a checkpoint, then stops"));
  interruptChild(*proc_);
}

bool RunsView::resume(QString* error) {
  if (job_file_.isEmpty()) {
    if (error) *error = tr("no job to resume");
    return false;
  }
  return launch(job_file_, error);
}

bool RunsView::openRun(const QString& dir, QString* error) {
  if (state_ == State::Running) {
    if (error) *error = tr("%1: not opened while this view's job runs (its curves are shown)").arg(dir);
    return false;
  }
  if (!QFileInfo::exists(dir + QStringLiteral("/run.h5"))) {
    if (error) *error = tr("%1: no run.h5 (not a training run directory, or the job has not started)").arg(dir);
    return false;
  }
  poll_->stop();
  run_dir_ = QFileInfo(dir).absoluteFilePath();
  job_file_.clear();  // Resume belongs to the view's own jobs
  global_step_ = total_steps_ = 0;
  addRun(run_dir_);
  const std::optional<train::JobOwner> owner = train::job_owner(toPath(run_dir_));
  const bool elsewhere = owner.has_value();
  can_interrupt_ = elsewhere && owner->pid > 0 && owner->host == train::this_host();
  setState(elsewhere ? State::Following : State::Idle);
  appendLog(tr("opened %1").arg(QDir::toNativeSeparators(run_dir_)));
  try {
    const train::RunSnapshot r = train::read_run(toPath(run_dir_) / "run.h5");
    auto number = [](double v, char format, int precision) {
      return std::isnan(v) ? QStringLiteral("-") : QString::number(v, format, precision);
    };
    for (size_t s = 0; s < r.stage_names.size(); ++s) {
      const train::StageSummary sum = train::summarize_stage(r, static_cast<int32_t>(s));
      const QString name = QString::fromStdString(r.stage_names[s]), kind = QString::fromStdString(r.stage_kinds[s]);
      appendLog(tr("  %1: %2 of %3 steps, loss %4, held out %5, %6 tokens/s")
                    .arg(name == kind ? name : tr("%1 (%2)").arg(name, kind))
                    .arg(sum.done)
                    .arg(r.planned_steps[s])
                    .arg(number(sum.loss, 'g', 4), number(sum.eval_loss, 'g', 4), number(sum.tokens_per_s, 'f', 0)));
    }
  } catch (const std::exception&) {
    // being created: the curves follow once it can be read
  }
  if (elsewhere) {
    appendLog(owner->pid > 0 ? tr("its job runs in process %1 on %2; its run.h5 is read every second")
                                   .arg(owner->pid)
                                   .arg(QString::fromStdString(owner->host))
                             : tr("its job runs in another process; its run.h5 is read every second"));
    poll_->start();
  }
  refreshCurves();
  return true;
}

void RunsView::addRun(const QString& dir) {
  const auto found = runs_list_->findItems(dir, Qt::MatchExactly);
  for (QListWidgetItem* item : found) delete runs_list_->takeItem(runs_list_->row(item));
  runs_list_->insertItem(0, dir);
  runs_list_->setCurrentRow(0);
  QStringList kept = runs();
  while (kept.size() > 20) kept.removeLast();
  options::kRecentRuns.set(kept);
}

QStringList RunsView::runs() const {
  QStringList out;
  for (int i = 0; i < runs_list_->count(); ++i) out << runs_list_->item(i)->text();
  return out;
}

QString RunsView::logText() const { return log_->toPlainText(); }

void RunsView::appendLog(const QString& line) { log_->appendPlainText(line); }

void RunsView::setState(State s) {
  state_ = s;
  const bool running = s == State::Running;
  cancel_button_->setEnabled(running || (s == State::Following && can_interrupt_));
  resume_button_->setEnabled(!running && (s == State::Interrupted || s == State::Failed) && !job_file_.isEmpty());
  new_button_->setEnabled(!running);
}

void RunsView::onOutput() {
  pending_ += proc_->readAllStandardOutput();
  takeEventLines(
      pending_, [this](const QJsonObject& e) { handleEvent(e); },
      [this](const QString& line) { appendLog(line); });  // warnings and anything else the job prints
}

void RunsView::handleEvent(const QJsonObject& e) {
  const QString ev = e.value(QStringLiteral("event")).toString();
  if (ev == QLatin1String("step")) {
    global_step_ = e.value(QStringLiteral("global_step")).toInt();
    last_loss_ = e.value(QStringLiteral("loss")).toDouble();
    if (total_steps_ > 0) progress_->setValue(std::min(global_step_, total_steps_));
    status_->setText(tr("%1: step %2 of %3 \u00b7 loss %4 \u00b7 %5 tokens/s \u00b7 ETA %6")
                         .arg(e.value(QStringLiteral("stage")).toString())
                         .arg(e.value(QStringLiteral("step")).toInt())
                         .arg(e.value(QStringLiteral("steps")).toInt())
                         .arg(last_loss_, 0, 'g', 4)
                         .arg(e.value(QStringLiteral("tokens_per_s")).toDouble(), 0, 'f', 0)
                         .arg(formatSeconds(e.value(QStringLiteral("eta_s")).toDouble(-1))));
    Q_EMIT progressed(global_step_, total_steps_);
    return;
  }
  if (ev == QLatin1String("start")) {
    // Planned steps of every stage come from run.h5 (the job has created it by now).
    try {
      total_steps_ = static_cast<int>(
          train::read_run(toPath(run_dir_) / "run.h5").total_steps());
      progress_->setRange(0, std::max(1, total_steps_));
    } catch (const std::exception&) {
    }
    appendLog(tr("started on %1%2").arg(e.value(QStringLiteral("device")).toString(),
                                        e.value(QStringLiteral("resumed")).toBool() ? tr(", resumed from a checkpoint")
                                                                                    : QString()));
  } else if (ev == QLatin1String("stage")) {
    appendLog(tr("stage %1 (%2): %3 steps").arg(e.value(QStringLiteral("stage")).toString(),
                                                 e.value(QStringLiteral("kind")).toString())
                  .arg(e.value(QStringLiteral("steps")).toInt()));
  } else if (ev == QLatin1String("eval")) {
    appendLog(tr("eval %1 step %2: loss %3").arg(e.value(QStringLiteral("stage")).toString())
                  .arg(e.value(QStringLiteral("step")).toInt())
                  .arg(e.value(QStringLiteral("loss")).toDouble(), 0, 'g', 5));
  } else if (ev == QLatin1String("checkpoint")) {
    appendLog(tr("checkpoint %1").arg(e.value(QStringLiteral("path")).toString()));
  } else if (ev == QLatin1String("error")) {
    appendLog(tr("error: %1").arg(e.value(QStringLiteral("message")).toString()));
  } else if (ev == QLatin1String("done")) {
    appendLog(tr("done: %1").arg(e.value(QStringLiteral("model")).toString()));
  } else if (ev == QLatin1String("interrupted")) {
    const QString ckpt = e.value(QStringLiteral("checkpoint")).toString();
    appendLog(ckpt.isEmpty() ? tr("interrupted before the first step; nothing new was written")
                             : tr("interrupted; checkpoint %1").arg(ckpt));
  }
}

void RunsView::onFinished(int exit_code, QProcess::ExitStatus status) {
  onOutput();
  poll_->stop();
  refreshCurves();
  if (status == QProcess::CrashExit) {
    appendLog(tr("the job crashed (%1)").arg(proc_->errorString()));
    setState(State::Failed);
  } else if (exit_code == 0) {
    setState(State::Done);
    progress_->setValue(progress_->maximum());
  } else if (exit_code == 130) {
    setState(State::Interrupted);
  } else {
    appendLog(tr("the job exited with status %1").arg(exit_code));
    setState(State::Failed);
  }
  status_->setText(tr("%1 \u00b7 %2").arg(QDir::toNativeSeparators(run_dir_), stateText()));
  Q_EMIT finished(status == QProcess::CrashExit ? -1 : exit_code);
}

int RunsView::curvePoints() const { return curve_points_; }
int RunsView::evalPoints() const { return eval_points_; }

void RunsView::refreshCurves() {
  if (run_dir_.isEmpty()) return;
  const std::filesystem::path run = toPath(run_dir_) / "run.h5";
  if (!std::filesystem::exists(run)) return;
  // A followed job's end is seen before the read, so that the read has every row it wrote.
  const bool ended = state_ == State::Following && !train::job_running(toPath(run_dir_));
  train::RunSnapshot r;
  try {
    r = train::read_run(run);
  } catch (const std::exception&) {
    return;  // being created: the next tick reads it
  }
  plot_->clearGraphs();
  curve_points_ = eval_points_ = 0;
  for (size_t s = 0; s < r.stage_names.size(); ++s) {
    const QColor colour = kStageColours[s % std::size(kStageColours)];
    const QString name = QString::fromStdString(r.stage_names[s]);
    QVector<double> x, y;
    for (size_t i = 0; i < r.stage.size(); ++i)
      if (r.stage[i] == static_cast<int32_t>(s) && r.loss[i] > 0) {
        x << static_cast<double>(r.step[i]);
        y << r.loss[i];
      }
    QCPGraph* g = plot_->addGraph();
    g->setName(name);
    g->setPen(QPen(colour, 1.5));
    g->setData(x, y, true);
    curve_points_ += static_cast<int>(x.size());
    // The held-out loss of the stage's evaluations, as points on the same axes.
    QVector<double> ex, ey;
    for (size_t i = 0; i < r.eval_stage.size(); ++i)
      if (r.eval_stage[i] == static_cast<int32_t>(s) && r.eval_loss[i] > 0) {
        ex << static_cast<double>(r.eval_step[i]);
        ey << r.eval_loss[i];
      }
    if (ex.isEmpty()) continue;
    QCPGraph* e = plot_->addGraph();
    e->setName(tr("%1, held out").arg(name));
    e->setLineStyle(QCPGraph::lsNone);
    e->setScatterStyle(QCPScatterStyle(QCPScatterStyle::ssCircle, QPen(colour, 1.5), QBrush(Qt::white), 7));
    e->setData(ex, ey, true);
    eval_points_ += static_cast<int>(ex.size());
  }
  if (total_steps_ == 0) {
    total_steps_ = static_cast<int>(r.total_steps());
    progress_->setRange(0, std::max(1, total_steps_));
  }
  if (state_ != State::Running) {
    // An opened run: the file says where it stands.
    const train::RunProgress p = train::run_progress(r, state_ == State::Following && !ended);
    const int before = global_step_;
    global_step_ = static_cast<int>(p.done);
    progress_->setValue(std::min(global_step_, std::max(1, total_steps_)));
    if (!r.loss.empty()) last_loss_ = r.loss.back();
    const QString line = QString::fromStdString(train::describe(p, r));
    if (ended) {
      poll_->stop();
      appendLog(tr("its job has ended: %1").arg(line));
    }
    if (ended || state_ == State::Idle)
      setState(p.state == train::RunProgress::State::Finished  ? State::Done
               : p.state == train::RunProgress::State::Stopped ? State::Stopped
                                                               : state_);
    status_->setText(tr("%1 \u00b7 %2").arg(QDir::toNativeSeparators(run_dir_), line));
    if (state_ == State::Following && global_step_ != before) Q_EMIT progressed(global_step_, total_steps_);
  }
  plot_->rescaleAxes();
  // A margin, so that the first and last points (a stage's final held-out loss) are not cut at the edges.
  plot_->xAxis->scaleRange(1.04, plot_->xAxis->range().center());
  plot_->yAxis->scaleRange(1.1, std::sqrt(plot_->yAxis->range().lower * plot_->yAxis->range().upper));
  plot_->replot();
}

QString RunsView::statusText() const { return status_->text(); }

}  // namespace hh::workbench
