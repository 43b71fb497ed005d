#pragma once
// The Calibration view: pick a task plugin and its parameters (the form is built from what the plugin
// declares), generate clean/corrupt pairs with the open model's tokenizer in a worker thread (progress,
// cancel), or load a JSONL set; browse the examples as decoded text with the needle and the answer
// highlighted, and hand the set to the Analysis view.
#include <QFutureWatcher>
#include <QString>
#include <QWidget>
#include <atomic>
#include <map>
#include <memory>
#include <vector>

class QComboBox;
class QFormLayout;
class QLabel;
class QListWidget;
class QProgressBar;
class QPushButton;
class QSpinBox;
class QTextBrowser;

namespace hh::interp {
struct CalibExample;
class TaskRegistry;
}  // namespace hh::interp
namespace hh::model {
class Tokenizer;
}

namespace hh::workbench {

class CalibrationView : public QWidget {
  Q_OBJECT

 public:
  explicit CalibrationView(QWidget* parent = nullptr);
  ~CalibrationView() override;

  void setModelDir(const QString& dir);  // the tokenizer that generation and decoding use
  QStringList taskIds() const;
  void setTask(const QString& id);
  QString task() const;
  // Sets a parameter of the current task from text ("384", "true", "noise"); false when unknown.
  bool setParam(const QString& name, const QString& value);
  void setCount(int n);
  void setSeed(int seed);

  // Generates into `jsonl` in a worker thread; generated() or failed() follows.
  bool generate(const QString& jsonl, QString* error);
  void cancel();
  bool isGenerating() const { return watcher_.isRunning(); }
  // Reads a calibration set (validated by the core reader); false with *error naming file and line.
  bool load(const QString& jsonl, QString* error);

  int exampleCount() const;
  QString file() const { return file_; }
  // The example as rich text: the clean prompt with the needle(s) marked, then the answer.
  QString exampleHtml(int index) const;
  void showExample(int index);
  QTextBrowser* browser() const { return browser_; }

 Q_SIGNALS:
  void generated(const QString& jsonl);
  void failed(const QString& message);
  void useForAnalysis(const QString& jsonl);

 private:
  void buildForm();
  void onGenerated();

  QString model_dir_, file_;
  std::unique_ptr<interp::TaskRegistry> registry_;
  std::unique_ptr<model::Tokenizer> tok_;
  std::vector<interp::CalibExample> examples_;
  std::map<QString, QWidget*> param_widgets_;
  QFutureWatcher<QString> watcher_;
  std::shared_ptr<std::atomic<bool>> cancel_;
  QString pending_file_;

  QComboBox* task_box_;
  QLabel* task_help_;
  QFormLayout* params_;
  QWidget* params_host_;
  QSpinBox* count_;
  QSpinBox* seed_;
  QPushButton* generate_button_;
  QPushButton* cancel_button_;
  QPushButton* load_button_;
  QPushButton* use_button_;
  QProgressBar* progress_;
  QLabel* status_;
  QListWidget* list_;
  QTextBrowser* browser_;
};

}  // namespace hh::workbench
