#include "job_dialog.h"

#include <QComboBox>
#include <QDialogButtonBox>
#include <QDir>
#include <QFile>
#include <QFileDialog>
#include <QFileInfo>
#include <QFormLayout>
#include <QHBoxLayout>
#include <QHeaderView>
#include <QLabel>
#include <QLineEdit>
#include <QPushButton>
#include <QSaveFile>
#include <QSpinBox>
#include <QTableWidget>
#include <QVBoxLayout>
#include <nlohmann/json.hpp>

#include "core/jobs/job.h"
#include "qt_util.h"

// Resources of a static library are registered by name, from the global namespace.
static void initWorkbenchResources() { Q_INIT_RESOURCE(workbench); }

namespace hh::workbench {

namespace {

using nlohmann::json;

enum Column { kStage, kSteps, kLr, kSeq, kBatch };

QWidget* withBrowse(QLineEdit* edit, QWidget* parent, bool folder, const QString& title) {
  auto* row = new QWidget(parent);
  auto* layout = new QHBoxLayout(row);
  layout->setContentsMargins(0, 0, 0, 0);
  auto* browse = new QPushButton(QStringLiteral("\u2026"), row);
  browse->setMaximumWidth(32);
  layout->addWidget(edit, 1);
  layout->addWidget(browse);
  QObject::connect(browse, &QPushButton::clicked, row, [edit, parent, folder, title] {
    const QString p = folder ? QFileDialog::getExistingDirectory(parent, title, edit->text())
                             : QFileDialog::getOpenFileName(parent, title, edit->text());
    if (!p.isEmpty()) edit->setText(p);
  });
  return row;
}

}  // namespace

JobDialog::JobDialog(QWidget* parent) : QDialog(parent) {
  initWorkbenchResources();
  setWindowTitle(tr("New Training Run"));
  template_ = new QComboBox(this);
  template_->addItems({QStringLiteral("three-stage-quick"), QStringLiteral("three-stage")});
  teacher_ = new QLineEdit(this);
  manifest_ = new QLineEdit(this);
  output_ = new QLineEdit(this);
  device_ = new QComboBox(this);
  // A template that asks for cuda (three-stage) keeps cpu where there is none (deviceChoices).
  device_->addItems(deviceChoices());
  text_data_ = new QLineEdit(this);
  text_data_->setPlaceholderText(tr("empty: retrieval and reasoning tasks (niah, variable tracking, induction)"));
  task_length_ = new QSpinBox(this);
  task_length_->setRange(64, 1048576);
  task_length_->setValue(512);
  task_length_->setToolTip(tr("Prompt length of the built-in tasks, in tokens"));
  stages_ = new QTableWidget(0, 5, this);
  stages_->setHorizontalHeaderLabels({tr("stage"), tr("steps"), tr("lr"), tr("seq_len"), tr("batch")});
  stages_->verticalHeader()->hide();
  stages_->horizontalHeader()->setSectionResizeMode(QHeaderView::Stretch);
  error_ = new QLabel(this);
  error_->setWordWrap(true);
  error_->setStyleSheet(QStringLiteral("color: #b00020;"));

  auto* form = new QFormLayout;
  form->addRow(tr("Template"), template_);
  form->addRow(tr("Teacher"), withBrowse(teacher_, this, true, tr("Teacher checkpoint")));
  form->addRow(tr("Manifest"), withBrowse(manifest_, this, false, tr("manifest.json")));
  form->addRow(tr("Output directory"), output_);
  form->addRow(tr("Device"), device_);
  form->addRow(tr("Text data (JSONL)"), withBrowse(text_data_, this, false, tr("Text data")));
  form->addRow(tr("Task length"), task_length_);
  auto* buttons = new QDialogButtonBox(QDialogButtonBox::Ok | QDialogButtonBox::Cancel, this);
  buttons->button(QDialogButtonBox::Ok)->setText(tr("Start"));
  connect(buttons, &QDialogButtonBox::accepted, this, &JobDialog::accept);
  connect(buttons, &QDialogButtonBox::rejected, this, &JobDialog::reject);
  auto* layout = new QVBoxLayout(this);
  layout->addLayout(form);
  layout->addWidget(stages_, 1);
  layout->addWidget(error_);
  layout->addWidget(buttons);
  connect(template_, &QComboBox::currentTextChanged, this, &JobDialog::loadTemplate);
  loadTemplate();
  resize(640, 560);
}

void JobDialog::loadTemplate() {
  QFile f(QStringLiteral(":/jobs/%1.json").arg(template_->currentText()));
  template_json_ = f.open(QIODevice::ReadOnly) ? QString::fromUtf8(f.readAll()) : QString();
  const json t = json::parse(template_json_.toStdString(), nullptr, false);
  stages_->setRowCount(0);
  if (t.is_discarded() || !t.contains("stages")) return;
  for (const auto& s : t.at("stages")) {
    const int row = stages_->rowCount();
    stages_->insertRow(row);
    auto* name = new QTableWidgetItem(QString::fromStdString(s.value("name", "")));
    name->setFlags(name->flags() & ~Qt::ItemIsEditable);
    stages_->setItem(row, kStage, name);
    stages_->setItem(row, kSteps, new QTableWidgetItem(QString::number(s.value("steps", 0))));
    stages_->setItem(row, kLr, new QTableWidgetItem(QString::number(s.value("lr", 0.0), 'g', 6)));
    stages_->setItem(row, kSeq, new QTableWidgetItem(QString::number(s.value("seq_len", 0))));
    stages_->setItem(row, kBatch, new QTableWidgetItem(QString::number(s.value("batch", 1))));
  }
  if (output_->text().isEmpty()) output_->setText(QDir::current().absoluteFilePath(QStringLiteral("runs/hybrid")));
  device_->setCurrentText(QString::fromStdString(t.value("device", "cpu")));
}

void JobDialog::setTemplate(const QString& name) { template_->setCurrentText(name); }
void JobDialog::setTeacher(const QString& dir) { teacher_->setText(dir); }
void JobDialog::setManifest(const QString& file) { manifest_->setText(file); }
void JobDialog::setOutput(const QString& dir) { output_->setText(dir); }
void JobDialog::setDevice(const QString& device) { device_->setCurrentText(device); }
void JobDialog::setTextData(const QString& jsonl) { text_data_->setText(jsonl); }
void JobDialog::setTaskLength(int tokens) { task_length_->setValue(tokens); }

QString JobDialog::jobFile() const {
  return QFileInfo(output_->text()).absoluteFilePath() + QStringLiteral(".job.json");
}

QString JobDialog::jobJson(QString* error) const {
  json j = json::parse(template_json_.toStdString(), nullptr, false);
  if (j.is_discarded()) {
    if (error) *error = tr("the template %1 cannot be read").arg(template_->currentText());
    return {};
  }
  j["description"] = "Made by the workbench from the " + template_->currentText().toStdString() + " template.";
  j["teacher"] = QFileInfo(teacher_->text()).absoluteFilePath().toStdString();
  j["manifest"] = QFileInfo(manifest_->text()).absoluteFilePath().toStdString();
  j["output"] = QFileInfo(output_->text()).absoluteFilePath().toStdString();
  j["device"] = device_->currentText().toStdString();
  // On the CPU the job's default: the checkpoint's dtype, or float32 for a 16-bit one (the template's
  // bf16 is for GPUs).
  if (device_->currentText() == QLatin1String("cpu")) j.erase("dtype");
  j.erase("calib");
  if (!text_data_->text().isEmpty()) {
    j["data"] = json::array({{{"jsonl", QFileInfo(text_data_->text()).absoluteFilePath().toStdString()}}});
  } else {
    const int n = task_length_->value();
    j["data"] = json::array({{{"task", "niah-single"}, {"params", {{"length", n}, {"random_depth", true}}}},
                             {{"task", "niah-multikey"}, {"params", {{"length", n}, {"random_depth", true}}}},
                             {{"task", "variable-tracking"}, {"params", {{"length", n}}}},
                             {{"task", "induction"}, {"params", {{"length", n}}}}});
  }
  for (int row = 0; row < stages_->rowCount() && row < static_cast<int>(j["stages"].size()); ++row) {
    json& s = j["stages"][static_cast<size_t>(row)];
    bool ok_steps = false, ok_lr = false, ok_seq = false, ok_batch = false;
    const long long steps = stages_->item(row, kSteps)->text().toLongLong(&ok_steps);
    const double lr = stages_->item(row, kLr)->text().toDouble(&ok_lr);
    const long long seq = stages_->item(row, kSeq)->text().toLongLong(&ok_seq);
    const long long batch = stages_->item(row, kBatch)->text().toLongLong(&ok_batch);
    if (!ok_steps || !ok_lr || !ok_seq || !ok_batch) {
      if (error) *error = tr("stage %1: steps, lr, seq_len and batch must be numbers").arg(stages_->item(row, kStage)->text());
      return {};
    }
    s["steps"] = steps;
    s["lr"] = lr;
    s["seq_len"] = seq;
    s["batch"] = batch;
    // Keep the schedule's proportions valid for short runs.
    if (s.contains("warmup") && s["warmup"].get<long long>() >= steps) s["warmup"] = steps / 10;
    if (s.contains("min_lr") && s["min_lr"].get<double>() > lr) s["min_lr"] = lr / 10;
    for (const char* every : {"checkpoint_every", "eval_every"})
      if (s.contains(every) && s[every].get<long long>() > steps) s[every] = std::max(1LL, steps);
  }
  return QString::fromStdString(j.dump(2) + "\n");
}

bool JobDialog::writeJob(QString* error) {
  QString why;
  const QString text = jobJson(&why);
  try {
    if (text.isEmpty()) throw std::runtime_error(why.toStdString());
    const std::filesystem::path file = toPath(jobFile());
    jobs::JobSpec::parse(json::parse(text.toStdString()), file.parent_path(), file.string());
  } catch (const std::exception& e) {
    why = QString::fromStdString(e.what());
    error_->setText(why);
    if (error) *error = why;
    return false;
  }
  QDir().mkpath(QFileInfo(jobFile()).absolutePath());
  QSaveFile out(jobFile());
  if (!out.open(QIODevice::WriteOnly) || out.write(text.toUtf8()) < 0 || !out.commit()) {
    why = tr("%1: cannot write (%2)").arg(jobFile(), out.errorString());
    error_->setText(why);
    if (error) *error = why;
    return false;
  }
  error_->clear();
  return true;
}

void JobDialog::accept() {
  if (writeJob(nullptr)) QDialog::accept();
}

}  // namespace hh::workbench
