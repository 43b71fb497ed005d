#include "calibration_view.h"

#include <torch/torch.h>

#include <QApplication>
#include <QCheckBox>
#include <QComboBox>
#include <QDir>
#include <QDoubleSpinBox>
#include <QFile>
#include <QFileDialog>
#include <QFileInfo>
#include <QFormLayout>
#include <QHBoxLayout>
#include <QLabel>
#include <QLineEdit>
#include <QListWidget>
#include <QPointer>
#include <QProgressBar>
#include <QPushButton>
#include <QSpinBox>
#include <QSplitter>
#include <QTextBrowser>
#include <QVBoxLayout>
#include <QtConcurrent/QtConcurrentRun>
#include <algorithm>

#include "core/interp/calibration.h"
#include "core/interp/patching.h"
#include "core/interp/task_registry.h"
#include "core/model/tokenizer.h"
#include "qt_util.h"

namespace hh::workbench {

namespace {

QString escaped(const std::string& text) { return QString::fromStdString(text).toHtmlEscaped(); }

}  // namespace

CalibrationView::CalibrationView(QWidget* parent)
    : QWidget(parent), registry_(std::make_unique<interp::TaskRegistry>()), cancel_(std::make_shared<std::atomic<bool>>(false)) {
  registry_->load_default();
  task_box_ = new QComboBox(this);
  task_box_->setObjectName(QStringLiteral("taskBox"));
  for (const auto& t : registry_->tasks()) task_box_->addItem(QString::fromStdString(t.id));
  task_help_ = new QLabel(this);
  task_help_->setWordWrap(true);
  params_host_ = new QWidget(this);
  params_ = new QFormLayout(params_host_);
  count_ = new QSpinBox(this);
  count_->setRange(1, 100000);
  count_->setValue(16);
  seed_ = new QSpinBox(this);
  seed_->setRange(0, 1000000000);
  generate_button_ = new QPushButton(tr("Generate\u2026"), this);
  cancel_button_ = new QPushButton(tr("Cancel"), this);
  cancel_button_->setEnabled(false);
  load_button_ = new QPushButton(tr("Load JSONL\u2026"), this);
  use_button_ = new QPushButton(tr("Use for Analysis"), this);
  use_button_->setEnabled(false);
  progress_ = new QProgressBar(this);
  progress_->setRange(0, 1000);
  status_ = new QLabel(tr("Open a model: its tokenizer makes and decodes the prompts."), this);
  status_->setWordWrap(true);
  list_ = new QListWidget(this);
  list_->setObjectName(QStringLiteral("exampleList"));
  browser_ = new QTextBrowser(this);
  browser_->setObjectName(QStringLiteral("exampleText"));

  auto* form = new QFormLayout;
  form->addRow(tr("Task"), task_box_);
  form->addRow(QString(), task_help_);
  form->addRow(tr("Pairs"), count_);
  form->addRow(tr("Seed"), seed_);
  auto* buttons = new QHBoxLayout;
  buttons->addWidget(generate_button_);
  buttons->addWidget(cancel_button_);
  buttons->addWidget(load_button_);
  buttons->addWidget(use_button_);
  buttons->addStretch(1);
  auto* left = new QWidget(this);
  auto* left_layout = new QVBoxLayout(left);
  left_layout->setContentsMargins(0, 0, 0, 0);
  left_layout->addLayout(form);
  left_layout->addWidget(params_host_);
  left_layout->addLayout(buttons);
  left_layout->addWidget(progress_);
  left_layout->addWidget(status_);
  left_layout->addWidget(list_, 1);
  auto* split = new QSplitter(this);
  split->addWidget(left);
  split->addWidget(browser_);
  split->setStretchFactor(1, 2);
  auto* layout = new QVBoxLayout(this);
  layout->addWidget(split);

  connect(task_box_, &QComboBox::currentTextChanged, this, &CalibrationView::buildForm);
  connect(list_, &QListWidget::currentRowChanged, this, &CalibrationView::showExample);
  connect(&watcher_, &QFutureWatcher<QString>::finished, this, &CalibrationView::onGenerated);
  connect(cancel_button_, &QPushButton::clicked, this, &CalibrationView::cancel);
  connect(use_button_, &QPushButton::clicked, this, [this] { Q_EMIT useForAnalysis(file_); });
  connect(generate_button_, &QPushButton::clicked, this, [this] {
    const QString f = QFileDialog::getSaveFileName(this, tr("Write calibration set"),
                                                   QDir::current().absoluteFilePath(task() + QStringLiteral(".jsonl")),
                                                   tr("JSONL (*.jsonl)"));
    QString error;
    if (!f.isEmpty() && !generate(f, &error)) status_->setText(error);
  });
  connect(load_button_, &QPushButton::clicked, this, [this] {
    const QString f = QFileDialog::getOpenFileName(this, tr("Calibration set"), QString(), tr("JSONL (*.jsonl)"));
    QString error;
    if (!f.isEmpty() && !load(f, &error)) status_->setText(error);
  });
  buildForm();
}

CalibrationView::~CalibrationView() {
  if (watcher_.isRunning()) {
    cancel_->store(true);
    watcher_.waitForFinished();
  }
}

void CalibrationView::setModelDir(const QString& dir) {
  model_dir_ = dir;
  try {
    tok_ = std::make_unique<model::Tokenizer>(model::Tokenizer::load(toPath(dir) / "tokenizer.json"));
    status_->setText(tr("Tokenizer of %1.").arg(QDir::toNativeSeparators(dir)));
  } catch (const std::exception& e) {
    tok_.reset();
    status_->setText(QString::fromStdString(e.what()));
  }
}

QStringList CalibrationView::taskIds() const {
  QStringList out;
  for (int i = 0; i < task_box_->count(); ++i) out << task_box_->itemText(i);
  return out;
}
void CalibrationView::setTask(const QString& id) { task_box_->setCurrentText(id); }
QString CalibrationView::task() const { return task_box_->currentText(); }
void CalibrationView::setCount(int n) { count_->setValue(n); }
void CalibrationView::setSeed(int seed) { seed_->setValue(seed); }

void CalibrationView::buildForm() {
  while (params_->rowCount() > 0) params_->removeRow(0);
  param_widgets_.clear();
  const interp::TaskInfo* info = registry_->find(task().toStdString());
  if (!info) return;
  task_help_->setText(QStringLiteral("%1 (%2)").arg(QString::fromStdString(info->description),
                                                   QString::fromStdString(info->kind)));
  for (const interp::TaskParam& p : info->params) {
    if (p.name == "num_examples") continue;  // the Pairs box
    QWidget* w = nullptr;
    switch (p.type) {
      case interp::ParamType::Int: {
        auto* s = new QSpinBox(params_host_);
        s->setRange(static_cast<int>(std::max(p.min, -2147483647.0)), static_cast<int>(std::min(p.max, 2147483647.0)));
        s->setValue(static_cast<int>(p.default_value.get<int64_t>()));
        w = s;
        break;
      }
      case interp::ParamType::Float: {
        auto* s = new QDoubleSpinBox(params_host_);
        s->setDecimals(3);
        s->setRange(p.min, p.max);
        s->setSingleStep((p.max - p.min) / 20);
        s->setValue(p.default_value.get<double>());
        w = s;
        break;
      }
      case interp::ParamType::Bool: {
        auto* c = new QCheckBox(params_host_);
        c->setChecked(p.default_value.get<bool>());
        w = c;
        break;
      }
      case interp::ParamType::String: {
        if (!p.choices.empty()) {
          auto* c = new QComboBox(params_host_);
          for (const auto& choice : p.choices) c->addItem(QString::fromStdString(choice));
          c->setCurrentText(QString::fromStdString(p.default_value.get<std::string>()));
          w = c;
        } else {
          w = new QLineEdit(QString::fromStdString(p.default_value.get<std::string>()), params_host_);
        }
        break;
      }
    }
    w->setToolTip(QString::fromStdString(p.description));
    param_widgets_[QString::fromStdString(p.name)] = w;
    params_->addRow(QString::fromStdString(p.name), w);
  }
}

bool CalibrationView::setParam(const QString& name, const QString& value) {
  auto it = param_widgets_.find(name);
  if (it == param_widgets_.end()) return false;
  QWidget* w = it->second;
  if (auto* s = qobject_cast<QSpinBox*>(w)) s->setValue(value.toInt());
  else if (auto* d = qobject_cast<QDoubleSpinBox*>(w)) d->setValue(value.toDouble());
  else if (auto* c = qobject_cast<QCheckBox*>(w)) c->setChecked(value == QLatin1String("true") || value == QLatin1String("1"));
  else if (auto* b = qobject_cast<QComboBox*>(w)) b->setCurrentText(value);
  else if (auto* e = qobject_cast<QLineEdit*>(w)) e->setText(value);
  return true;
}

bool CalibrationView::generate(const QString& jsonl, QString* error) {
  auto fail = [error](const QString& why) {
    if (error) *error = why;
    return false;
  };
  if (watcher_.isRunning()) return fail(tr("a set is being generated"));
  if (!tok_) return fail(tr("open a model first: the prompts are made with its tokenizer"));
  nlohmann::json params = nlohmann::json::object();
  params["num_examples"] = count_->value();
  for (const auto& [name, w] : param_widgets_) {
    const std::string key = name.toStdString();
    if (auto* s = qobject_cast<QSpinBox*>(w)) params[key] = s->value();
    else if (auto* d = qobject_cast<QDoubleSpinBox*>(w)) params[key] = d->value();
    else if (auto* c = qobject_cast<QCheckBox*>(w)) params[key] = c->isChecked();
    else if (auto* b = qobject_cast<QComboBox*>(w)) params[key] = b->currentText().toStdString();
    else if (auto* e = qobject_cast<QLineEdit*>(w)) params[key] = e->text().toStdString();
  }
  cancel_->store(false);
  pending_file_ = QFileInfo(jsonl).absoluteFilePath();
  QPointer<CalibrationView> self(this);
  const std::string id = task().toStdString();
  const uint64_t seed = static_cast<uint64_t>(seed_->value());
  const interp::TaskRegistry* reg = registry_.get();
  const model::Tokenizer* tok = tok_.get();
  auto cancel = cancel_;
  const std::filesystem::path out = toPath(pending_file_);
  generate_button_->setEnabled(false);
  cancel_button_->setEnabled(true);
  progress_->setValue(0);
  status_->setText(tr("generating %1 pairs of %2\u2026").arg(count_->value()).arg(task()));
  watcher_.setFuture(QtConcurrent::run([=]() -> QString {
    try {
      const auto examples = reg->generate(
          id, params, *tok, seed,
          [self](double f, std::size_t) {
            QMetaObject::invokeMethod(qApp, [self, f] { if (self) self->progress_->setValue(static_cast<int>(f * 1000)); },
                                      Qt::QueuedConnection);
          },
          [cancel] { return cancel->load(); });
      interp::write_calibration(out, examples);
      return {};
    } catch (const interp::Cancelled&) {
      return QStringLiteral("cancelled: nothing was written");
    } catch (const std::exception& e) {
      return QString::fromStdString(e.what());
    }
  }));
  return true;
}

void CalibrationView::cancel() {
  if (watcher_.isRunning()) cancel_->store(true);
}

void CalibrationView::onGenerated() {
  generate_button_->setEnabled(true);
  cancel_button_->setEnabled(false);
  const QString result = watcher_.result();
  QString error;
  if (result.isEmpty() && load(pending_file_, &error)) {
    progress_->setValue(1000);
    Q_EMIT generated(pending_file_);
    return;
  }
  const QString why = result.isEmpty() ? error : result;
  status_->setText(why);
  Q_EMIT failed(why);
}

bool CalibrationView::load(const QString& jsonl, QString* error) {
  try {
    examples_ = interp::read_calibration(toPath(jsonl), tok_.get(), -1);
  } catch (const std::exception& e) {
    if (error) *error = QString::fromStdString(e.what());
    return false;
  }
  file_ = QFileInfo(jsonl).absoluteFilePath();
  list_->clear();
  for (size_t i = 0; i < examples_.size(); ++i) {
    const auto& ex = examples_[i];
    const QString answer = tok_ ? QString::fromStdString(tok_->decode(ex.answer_ids)) : QString::fromStdString(ex.answer);
    list_->addItem(QStringLiteral("%1 \u00b7 %2 \u00b7 %3 tokens \u00b7 answer \u201c%4\u201d")
                       .arg(i)
                       .arg(QString::fromStdString(ex.task))
                       .arg(ex.clean_ids.size())
                       .arg(answer.trimmed()));
  }
  status_->setText(tr("%1: %2 pairs").arg(QDir::toNativeSeparators(file_)).arg(examples_.size()));
  use_button_->setEnabled(!examples_.empty());
  if (!examples_.empty()) list_->setCurrentRow(0);
  return true;
}

int CalibrationView::exampleCount() const { return static_cast<int>(examples_.size()); }

QString CalibrationView::exampleHtml(int index) const {
  if (index < 0 || index >= exampleCount()) return {};
  const interp::CalibExample& ex = examples_[static_cast<size_t>(index)];
  auto decode = [&](int64_t a, int64_t b) -> std::string {
    if (!tok_) return {};
    return tok_->decode(std::vector<int64_t>(ex.clean_ids.begin() + a, ex.clean_ids.begin() + b));
  };
  auto spans = interp::needle_spans(ex);
  std::sort(spans.begin(), spans.end());
  const int64_t T = static_cast<int64_t>(ex.clean_ids.size());
  QString html = QStringLiteral("<div style='white-space: pre-wrap; font-family: monospace;'>");
  int64_t pos = 0;
  for (auto [a, b] : spans) {
    a = std::clamp<int64_t>(a, pos, T);
    b = std::clamp<int64_t>(b, a, T);
    html += escaped(decode(pos, a));
    html += QStringLiteral("<span style='background-color: #ffe08a;' title='needle'>") + escaped(decode(a, b)) +
            QStringLiteral("</span>");
    pos = b;
  }
  html += escaped(decode(pos, T));
  const std::string answer = tok_ ? tok_->decode(ex.answer_ids) : ex.answer;
  html += QStringLiteral("<span style='background-color: #b7e4c7;' title='answer'>") + escaped(answer) +
          QStringLiteral("</span></div>");
  const int64_t diff = interp::first_difference(ex.clean_ids, ex.corrupt_ids);
  html += QStringLiteral("<p><b>%1</b> \u00b7 %2 tokens \u00b7 the corrupt prompt differs from token %3%4</p>")
              .arg(QString::fromStdString(ex.task))
              .arg(T)
              .arg(diff)
              .arg(ex.wrong_ids.empty() || !tok_
                       ? QString()
                       : tr(" \u00b7 wrong answer \u201c%1\u201d").arg(escaped(tok_->decode(ex.wrong_ids))));
  return html;
}

void CalibrationView::showExample(int index) { browser_->setHtml(exampleHtml(index)); }

}  // namespace hh::workbench
