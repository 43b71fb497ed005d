#pragma once
// The New Run dialog: a job spec for `hydrahead train` made from one of the shipped templates
// (resources/jobs), with the teacher, manifest, output directory, device, data and each stage's
// steps, learning rate, sequence length and batch filled in. The spec is checked by the core's job
// parser before it is written (atomically) next to the output directory.
#include <QDialog>
#include <QString>

class QComboBox;
class QLabel;
class QLineEdit;
class QSpinBox;
class QTableWidget;

namespace hh::workbench {

class JobDialog : public QDialog {
  Q_OBJECT

 public:
  explicit JobDialog(QWidget* parent = nullptr);

  void setTemplate(const QString& name);  // "three-stage-quick" or "three-stage"
  void setTeacher(const QString& dir);
  void setManifest(const QString& file);
  void setOutput(const QString& dir);
  void setDevice(const QString& device);
  void setTextData(const QString& jsonl);  // empty: the built-in task mix
  void setTaskLength(int tokens);
  QTableWidget* stages() const { return stages_; }  // columns: stage, steps, lr, seq_len, batch

  // The spec as it would be written, and the file it goes to (<output>.job.json).
  QString jobJson(QString* error) const;
  QString jobFile() const;
  // Checks and writes the spec; false with *error (also shown in the dialog) when it is not valid.
  bool writeJob(QString* error);

 public Q_SLOTS:
  void accept() override;

 private:
  void loadTemplate();

  QComboBox* template_;
  QLineEdit* teacher_;
  QLineEdit* manifest_;
  QLineEdit* output_;
  QComboBox* device_;
  QLineEdit* text_data_;
  QSpinBox* task_length_;
  QTableWidget* stages_;
  QLabel* error_;
  QString template_json_;
};

}  // namespace hh::workbench
