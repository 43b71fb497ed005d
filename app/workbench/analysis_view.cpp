#include "analysis_view.h"

#include <torch/torch.h>

#include <QApplication>
#include <QCheckBox>
#include <QComboBox>
#include <QDir>
#include <QFile>
#include <QFileDialog>
#include <QFileInfo>
#include <QFormLayout>
#include <QHBoxLayout>
#include <QLabel>
#include <QLineEdit>
#include <QPlainTextEdit>
#include <QPointer>
#include <QProgressBar>
#include <QPushButton>
#include <QVBoxLayout>
#include <QtConcurrent/QtConcurrentRun>

#include "core/interp/analysis.h"
#include "core/interp/calibration.h"
#include "core/interp/task_registry.h"
#include "core/model/tokenizer.h"
#include "core/util/error.h"
#include "hydrahead/version.h"
#include "settings.h"
#include "qt_util.h"

namespace hh::workbench {

namespace {

const char* const kMethods[] = {"activation", "path", "attribution", "retrieval", "similarity"};

}  // namespace

AnalysisView::AnalysisView(QWidget* parent) : QWidget(parent), cancel_(std::make_shared<std::atomic<bool>>(false)) {
  model_label_ = new QLabel(tr("No model open (File \u203a Open Checkpoint\u2026)"), this);
  model_label_->setWordWrap(true);
  calib_ = new QLineEdit(this);
  calib_->setPlaceholderText(tr("calibration set (JSONL from `hydrahead tasks generate`)"));
  auto* browse_calib = new QPushButton(QStringLiteral("\u2026"), this);
  generate_button_ = new QPushButton(tr("Generate NIAH set"), this);
  generate_button_->setToolTip(tr("8 niah-single and 8 variable-tracking pairs at 512 tokens, next to the output"));
  auto* calib_row = new QHBoxLayout;
  calib_row->addWidget(calib_, 1);
  calib_row->addWidget(browse_calib);
  calib_row->addWidget(generate_button_);
  out_ = new QLineEdit(QDir::current().absoluteFilePath(QStringLiteral("analysis.h5")), this);
  auto* browse_out = new QPushButton(QStringLiteral("\u2026"), this);
  auto* out_row = new QHBoxLayout;
  out_row->addWidget(out_, 1);
  out_row->addWidget(browse_out);
  auto* methods_row = new QHBoxLayout;
  for (const char* m : kMethods) {
    auto* box = new QCheckBox(QString::fromLatin1(m), this);
    box->setChecked(true);
    method_boxes_.push_back(box);
    methods_row->addWidget(box);
  }
  methods_row->addStretch(1);
  mode_ = new QComboBox(this);
  mode_->addItems({QStringLiteral("noising"), QStringLiteral("denoising")});
  metric_ = new QComboBox(this);
  metric_->addItems({QStringLiteral("logprob"), QStringLiteral("logit-diff")});
  device_ = new QComboBox(this);
  device_->addItems(deviceChoices());
  dtype_ = new QComboBox(this);
  dtype_->addItems({QStringLiteral("f32"), QStringLiteral("bf16"), QStringLiteral("f16")});
  auto* form = new QFormLayout;
  form->addRow(tr("Model"), model_label_);
  form->addRow(tr("Calibration"), calib_row);
  form->addRow(tr("Output"), out_row);
  form->addRow(tr("Methods"), methods_row);
  form->addRow(tr("Mode"), mode_);
  form->addRow(tr("Metric"), metric_);
  form->addRow(tr("Device"), device_);
  form->addRow(tr("Precision"), dtype_);

  run_button_ = new QPushButton(tr("Run Analysis"), this);
  cancel_button_ = new QPushButton(tr("Cancel"), this);
  cancel_button_->setEnabled(false);
  progress_ = new QProgressBar(this);
  progress_->setRange(0, 1000);
  step_ = new QLabel(this);
  log_ = new QPlainTextEdit(this);
  log_->setReadOnly(true);
  log_->setMaximumBlockCount(500);
  auto* buttons = new QHBoxLayout;
  buttons->addWidget(run_button_);
  buttons->addWidget(cancel_button_);
  buttons->addStretch(1);
  auto* layout = new QVBoxLayout(this);
  layout->addLayout(form);
  layout->addLayout(buttons);
  layout->addWidget(progress_);
  layout->addWidget(step_);
  layout->addWidget(log_, 1);

  connect(run_button_, &QPushButton::clicked, this, [this] {
    QString error;
    if (!start(&error)) appendLog(error);
  });
  connect(cancel_button_, &QPushButton::clicked, this, &AnalysisView::cancel);
  connect(browse_calib, &QPushButton::clicked, this, [this] {
    const QString f = QFileDialog::getOpenFileName(this, tr("Calibration set"), calib_->text(), tr("JSONL (*.jsonl)"));
    if (!f.isEmpty()) calib_->setText(f);
  });
  connect(browse_out, &QPushButton::clicked, this, [this] {
    const QString f = QFileDialog::getSaveFileName(this, tr("Analysis file"), out_->text(), tr("HDF5 (*.h5)"));
    if (!f.isEmpty()) out_->setText(f);
  });
  connect(generate_button_, &QPushButton::clicked, this, [this] {
    QString error;
    if (!generateCalibration(QFileInfo(output()).absolutePath(), 8, 512, &error)) appendLog(error);
  });
  connect(&watcher_, &QFutureWatcher<QString>::finished, this, &AnalysisView::onFinished);

  // The last choices come back, and every change is remembered.
  setMethods(options::kAnalysisMethods.get());
  if (device_->findText(options::kAnalysisDevice.get()) >= 0) device_->setCurrentText(options::kAnalysisDevice.get());
  dtype_->setCurrentText(options::kAnalysisDtype.get());
  for (QCheckBox* box : method_boxes_)
    connect(box, &QCheckBox::toggled, this, [this] { options::kAnalysisMethods.set(methods()); });
  connect(device_, &QComboBox::currentTextChanged, this, [](const QString& d) { options::kAnalysisDevice.set(d); });
  connect(dtype_, &QComboBox::currentTextChanged, this, [](const QString& d) { options::kAnalysisDtype.set(d); });
}

AnalysisView::~AnalysisView() {
  if (watcher_.isRunning()) {
    cancel_->store(true);
    watcher_.waitForFinished();
  }
}

void AnalysisView::setModelDir(const QString& dir) {
  model_dir_ = dir;
  model_label_->setText(QDir::toNativeSeparators(dir));
}
void AnalysisView::setCalibration(const QString& jsonl) { calib_->setText(jsonl); }
void AnalysisView::setOutput(const QString& h5) { out_->setText(h5); }
QString AnalysisView::output() const { return QFileInfo(out_->text()).absoluteFilePath(); }
void AnalysisView::setDevice(const QString& device) { device_->setCurrentText(device); }

void AnalysisView::setMethods(const QStringList& methods) {
  for (QCheckBox* box : method_boxes_) box->setChecked(methods.contains(box->text()));
}

QStringList AnalysisView::methods() const {
  QStringList out;
  for (QCheckBox* box : method_boxes_)
    if (box->isChecked()) out << box->text();
  return out;
}

QString AnalysisView::logText() const { return log_->toPlainText(); }
void AnalysisView::appendLog(const QString& line) { log_->appendPlainText(line); }

bool AnalysisView::generateCalibration(const QString& dir, int n, int length, QString* error) {
  if (model_dir_.isEmpty()) {
    if (error) *error = tr("open a model first: the calibration set uses its tokenizer");
    return false;
  }
  try {
    const auto tok = model::Tokenizer::load(toPath(model_dir_) / "tokenizer.json");
    interp::TaskRegistry reg;
    reg.load_default();
    auto examples = reg.generate("niah-single", {{"num_examples", n}, {"length", length}, {"random_depth", true}}, tok, 1);
    const auto reasoning = reg.generate("variable-tracking", {{"num_examples", n}, {"length", length}}, tok, 2);
    examples.insert(examples.end(), reasoning.begin(), reasoning.end());
    QDir().mkpath(dir);
    const QString file = QDir(dir).absoluteFilePath(QStringLiteral("calib.jsonl"));
    interp::write_calibration(toPath(file), examples);
    setCalibration(file);
    appendLog(tr("wrote %1: %2 niah-single and %2 variable-tracking pairs of %3 tokens").arg(file).arg(n).arg(length));
  } catch (const std::exception& e) {
    if (error) *error = QString::fromStdString(e.what());
    return false;
  }
  return true;
}

bool AnalysisView::start(QString* error) {
  auto fail = [error](const QString& why) {
    if (error) *error = why;
    return false;
  };
  if (watcher_.isRunning()) return fail(tr("an analysis is running"));
  if (model_dir_.isEmpty()) return fail(tr("open a model first"));
  if (calib_->text().isEmpty()) return fail(tr("choose or generate a calibration set"));
  if (methods().isEmpty()) return fail(tr("choose at least one method"));
  interp::AnalyzeCheckpoint job;
  try {
    interp::parse_methods(methods().join(QLatin1Char(',')).toStdString(), job.options);
    job.options.mode = interp::parse_mode(mode_->currentText().toStdString());
    job.options.metric = interp::parse_metric(metric_->currentText().toStdString());
  } catch (const std::exception& e) {
    return fail(QString::fromStdString(e.what()));
  }
  job.model_dir = toPath(model_dir_);
  job.calib = toPath(calib_->text());
  job.out = toPath(output());
  job.device = device_->currentText().toStdString();
  job.dtype = dtype_->currentText().toStdString();
  job.created_by = std::string("hydrahead-workbench ") + HYDRAHEAD_VERSION;
  cancel_->store(false);
  std::shared_ptr<std::atomic<bool>> cancel = cancel_;
  job.options.cancel = cancel.get();
  QPointer<AnalysisView> self(this);
  job.options.progress = [self](const std::string& step, int64_t done, int64_t total) {
    const double f = static_cast<double>(done) / static_cast<double>(std::max<int64_t>(total, 1));
    const QString s = QString::fromStdString(step);
    QMetaObject::invokeMethod(
        qApp, [self, f, s] { if (self) self->onProgress(f, s); }, Qt::QueuedConnection);
  };
  auto started = [self](const std::string& what) {
    const QString s = QString::fromStdString(what);
    QMetaObject::invokeMethod(qApp, [self, s] { if (self) self->appendLog(s); }, Qt::QueuedConnection);
  };
  running_out_ = output();
  fraction_ = 0;
  progress_->setValue(0);
  step_->setText(tr("loading the model\u2026"));
  clock_.start();
  setRunning(true);
  watcher_.setFuture(QtConcurrent::run([job, cancel, started]() -> QString {
    try {
      interp::analyze_checkpoint(job, started);
      return {};
    } catch (const Cancelled&) {
      return QStringLiteral("cancelled: nothing was written");
    } catch (const std::exception& e) {
      return QString::fromStdString(e.what());
    }
  }));
  return true;
}

void AnalysisView::cancel() {
  if (!watcher_.isRunning()) return;
  cancel_->store(true);
  step_->setText(tr("cancelling after the current forward\u2026"));
}

void AnalysisView::onProgress(double fraction, const QString& step) {
  fraction_ = fraction;
  progress_->setValue(static_cast<int>(fraction * 1000));
  const double elapsed = static_cast<double>(clock_.elapsed()) / 1000.0;
  const QString eta = fraction > 0.02 ? formatSeconds(elapsed / fraction - elapsed) : tr("estimating");
  step_->setText(tr("%1 \u00b7 %2 % \u00b7 elapsed %3 \u00b7 ETA %4")
                     .arg(step)
                     .arg(fraction * 100, 0, 'f', 1)
                     .arg(formatSeconds(elapsed), eta));
  Q_EMIT progressed(fraction, step);
}

void AnalysisView::onFinished() {
  setRunning(false);
  const QString result = watcher_.result();
  if (result.isEmpty()) {
    progress_->setValue(1000);
    step_->setText(tr("done in %1").arg(formatSeconds(static_cast<double>(clock_.elapsed()) / 1000.0)));
    appendLog(tr("wrote %1").arg(running_out_));
    Q_EMIT analysisWritten(running_out_);
  } else {
    step_->setText(result);
    appendLog(result);
    Q_EMIT analysisFailed(result);
  }
}

void AnalysisView::setRunning(bool running) {
  run_button_->setEnabled(!running);
  generate_button_->setEnabled(!running);
  cancel_button_->setEnabled(running);
}

}  // namespace hh::workbench
