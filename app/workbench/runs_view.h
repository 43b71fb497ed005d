#pragma once
// The Runs view: training jobs launched as `hydrahead train --job J --progress json` child processes
// (a crash of the job never takes the window down), followed live through their JSON events (state,
// progress, ETA, log tail) and their run.h5 (loss curves per stage, read under SWMR every second while
// the job writes it). Cancel sends SIGINT, so the job checkpoints and exits 130; Resume starts the same
// job again, which continues from its checkpoint. Runs open from their directory: a finished or
// stopped one as it is, and one whose job is running elsewhere (`hydrahead train` in a terminal, a job
// that holds the directory's lock) followed through its run.h5 until that job ends.
#include <QJsonObject>
#include <QProcess>
#include <QString>
#include <QStringList>
#include <QWidget>
#include <vector>

class QCustomPlot;
class QLabel;
class QListWidget;
class QPlainTextEdit;
class QProgressBar;
class QPushButton;
class QTimer;

namespace hh::workbench {

class RunsView : public QWidget {
  Q_OBJECT

 public:
  // Running: the view's own job. Following: a job of another process, read from its run.h5 (no
  // Cancel; its end is Done or Stopped). Stopped: an opened run whose job ended before its last step.
  enum class State { Idle, Running, Following, Done, Stopped, Interrupted, Failed };

  explicit RunsView(QWidget* parent = nullptr);
  ~RunsView() override;

  // The `hydrahead` program the view runs (default: next to this executable).
  void setProgram(const QString& path) { program_ = path; }
  QString program() const { return program_; }

  // Starts the job; false with *error when one is running or the spec has no readable "output".
  bool launch(const QString& job_file, QString* error);
  // SIGINT: the job checkpoints and exits 130. The view's own job, or a followed one that runs on this
  // host (train::interrupt_job).
  void cancel();
  bool resume(QString* error);    // the last job again, from its checkpoint
  // Shows an existing run directory (its run.h5) and, while a job of another process holds it, follows
  // it every second; false with *error when it has no run.h5 or the view's own job is running.
  bool openRun(const QString& dir, QString* error);

  State state() const { return state_; }
  QString stateText() const;
  QString statusText() const;     // the line above the progress bar
  int globalStep() const { return global_step_; }
  int totalSteps() const { return total_steps_; }
  double lastLoss() const { return last_loss_; }
  QString runDirectory() const { return run_dir_; }
  QString logText() const;
  QCustomPlot* plot() const { return plot_; }
  int curvePoints() const;        // loss rows drawn, all stages
  int evalPoints() const;         // held-out losses drawn (points), all stages
  QStringList runs() const;       // directories in the list, newest first (kept across sessions)
  // Reads run.h5 now (the timer does this every second while a job runs).
  void refreshCurves();

 Q_SIGNALS:
  void progressed(int global_step, int total_steps);
  void finished(int exit_code);

 private:
  void onOutput();
  void onFinished(int exit_code, QProcess::ExitStatus status);
  void handleEvent(const QJsonObject& e);
  void appendLog(const QString& line);
  void setState(State s);
  void addRun(const QString& dir);

  QString program_;
  QString job_file_, run_dir_;
  QProcess* proc_ = nullptr;
  QByteArray pending_;
  State state_ = State::Idle;
  int global_step_ = 0, total_steps_ = 0;
  double last_loss_ = 0;
  int curve_points_ = 0, eval_points_ = 0;
  bool can_interrupt_ = false;  // a followed job of this host, which names its process

  QListWidget* runs_list_;
  QPushButton* new_button_;
  QPushButton* open_button_;
  QPushButton* cancel_button_;
  QPushButton* resume_button_;
  QLabel* status_;
  QProgressBar* progress_;
  QCustomPlot* plot_;
  QPlainTextEdit* log_;
  QTimer* poll_;
};

}  // namespace hh::workbench
