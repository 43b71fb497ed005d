#pragma once
// The Analysis view: runs the causal analysis (interp::analyze_checkpoint, the code behind
// `hydrahead analyze`) on the open model and a calibration set in a worker thread, with progress, ETA
// and cancel, so the window stays responsive; the finished analysis.h5 opens in the Heads and Layers
// views. A small NIAH + variable-tracking calibration set can be generated in place.
#include <QElapsedTimer>
#include <QFutureWatcher>
#include <QString>
#include <QStringList>
#include <QWidget>
#include <atomic>
#include <memory>

class QCheckBox;
class QComboBox;
class QLabel;
class QLineEdit;
class QPlainTextEdit;
class QProgressBar;
class QPushButton;

namespace hh::workbench {

class AnalysisView : public QWidget {
  Q_OBJECT

 public:
  explicit AnalysisView(QWidget* parent = nullptr);
  ~AnalysisView() override;  // cancels a running analysis and waits for it

  void setModelDir(const QString& dir);
  QString modelDir() const { return model_dir_; }
  void setCalibration(const QString& jsonl);
  void setOutput(const QString& h5);
  QString output() const;
  void setMethods(const QStringList& methods);  // activation, path, attribution, retrieval, similarity
  QStringList methods() const;
  void setDevice(const QString& device);

  // Writes `dir`/calib.jsonl: n niah-single pairs (random depth) and n variable-tracking pairs at
  // `length` tokens, with the open model's tokenizer, and makes it the calibration set.
  bool generateCalibration(const QString& dir, int n, int length, QString* error);

  // Starts the analysis; false with *error when one runs or the inputs are missing.
  bool start(QString* error);
  void cancel();
  bool isRunning() const { return watcher_.isRunning(); }
  double fraction() const { return fraction_; }
  QString logText() const;

 Q_SIGNALS:
  void progressed(double fraction, const QString& step);
  void analysisWritten(const QString& path);
  void analysisFailed(const QString& message);  // also "cancelled: nothing was written"

 private:
  void onProgress(double fraction, const QString& step);
  void onFinished();
  void appendLog(const QString& line);
  void setRunning(bool running);

  QString model_dir_;
  QLabel* model_label_;
  QLineEdit* calib_;
  QLineEdit* out_;
  std::vector<QCheckBox*> method_boxes_;
  QComboBox* mode_;
  QComboBox* metric_;
  QComboBox* device_;
  QComboBox* dtype_;
  QPushButton* run_button_;
  QPushButton* cancel_button_;
  QPushButton* generate_button_;
  QProgressBar* progress_;
  QLabel* step_;
  QPlainTextEdit* log_;

  QFutureWatcher<QString> watcher_;  // result: "" on success, else the error
  std::shared_ptr<std::atomic<bool>> cancel_;
  QElapsedTimer clock_;
  double fraction_ = 0;
  QString running_out_;
};

}  // namespace hh::workbench
