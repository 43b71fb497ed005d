#include "eval_view.h"

#include <torch/torch.h>

#include <QComboBox>
#include <QCoreApplication>
#include <QDateTime>
#include <QFile>
#include <QFileDialog>
#include <QFileInfo>
#include <QGridLayout>
#include <QHBoxLayout>
#include <QJsonObject>
#include <QLabel>
#include <QLineEdit>
#include <QProgressBar>
#include <QPushButton>
#include <QVBoxLayout>
#include <csignal>

#include "core/io/h5.h"
#include "core/util/error.h"
#include "export.h"
#include "qcustomplot_include.h"
#include "qt_util.h"

namespace hh::workbench {

double NiahGrid::mean() const {
  double s = 0;
  for (double a : accuracy) s += a;
  return accuracy.empty() ? 0 : s / static_cast<double>(accuracy.size());
}

namespace {

// Reads `group`/niah/* and `group`/ppl/ppl where present.
void readModel(const io::H5File& f, const std::string& group, std::optional<NiahGrid>* grid, std::optional<double>* ppl) {
  if (f.exists(group + "/niah/accuracy")) {
    NiahGrid g;
    const at::Tensor acc = f.read(group + "/niah/accuracy").to(at::kDouble).contiguous();
    const at::Tensor len = f.read(group + "/niah/lengths").to(at::kLong).contiguous();
    const at::Tensor dep = f.read(group + "/niah/depths").to(at::kDouble).contiguous();
    if (acc.dim() != 2 || acc.size(0) != len.numel() || acc.size(1) != dep.numel())
      throw Error(f.path().string() + ": " + group + "/niah/accuracy does not match its lengths and depths");
    g.lengths.assign(len.data_ptr<int64_t>(), len.data_ptr<int64_t>() + len.numel());
    g.depths.assign(dep.data_ptr<double>(), dep.data_ptr<double>() + dep.numel());
    g.accuracy.assign(acc.data_ptr<double>(), acc.data_ptr<double>() + acc.numel());
    *grid = g;
  }
  if (f.exists(group + "/ppl/ppl")) *ppl = f.read(group + "/ppl/ppl").to(at::kDouble)[0].item<double>();
}

}  // namespace

EvalView::EvalView(QWidget* parent) : QWidget(parent) {
  program_ = QCoreApplication::applicationDirPath() + QStringLiteral("/hydrahead");
  auto* grid = new QGridLayout;
  const QString names[2] = {tr("Teacher"), tr("Hybrid")};
  lengths_ = new QLineEdit(QStringLiteral("512,1024,2048"), this);
  lengths_->setToolTip(tr("Context lengths of the NIAH grid, in tokens (1K = 1024)"));
  device_ = new QComboBox(this);
  device_->addItems(deviceChoices());
  device_->setToolTip(tr("Where Evaluate runs the model (on the CPU a 16-bit checkpoint runs in float32)"));
  progress_ = new QProgressBar(this);
  progress_->setRange(0, 1);
  progress_->setValue(0);
  progress_->setVisible(false);
  cancel_button_ = new QPushButton(tr("Cancel"), this);
  cancel_button_->setEnabled(false);
  cancel_button_->setToolTip(tr("Stop the evaluation; it writes nothing"));
  for (int side = 0; side < 2; ++side) {
    titles_[side] = new QLabel(tr("%1: no evaluation open").arg(names[side]), this);
    auto* open = new QPushButton(tr("Open %1 eval.h5\u2026").arg(names[side].toLower()), this);
    plots_[side] = new QCustomPlot(this);
    plots_[side]->setObjectName(side == 0 ? QStringLiteral("teacherNiah") : QStringLiteral("hybridNiah"));
    plots_[side]->setMinimumSize(320, 260);
    addExportMenu(plots_[side]);
    auto* head = new QHBoxLayout;
    head->addWidget(titles_[side], 1);
    head->addWidget(open);
    model_edit_[side] = new QLineEdit(this);
    model_edit_[side]->setPlaceholderText(tr("%1 checkpoint folder").arg(names[side].toLower()));
    run_buttons_[side] = new QPushButton(tr("Evaluate"), this);
    auto* run_row = new QHBoxLayout;
    run_row->addWidget(model_edit_[side], 1);
    run_row->addWidget(run_buttons_[side]);
    grid->addLayout(head, 0, side);
    grid->addLayout(run_row, 1, side);
    grid->addWidget(plots_[side], 2, side);
    connect(run_buttons_[side], &QPushButton::clicked, this, [this, side] {
      QString error;
      if (!evaluate(model_edit_[side]->text(), static_cast<Side>(side), lengths_->text(), 10, &error))
        summary_->setText(error);
    });
    connect(open, &QPushButton::clicked, this, [this, side] {
      const QString f = QFileDialog::getOpenFileName(this, tr("Evaluation file"), QString(), tr("HDF5 (*.h5)"));
      QString error;
      if (!f.isEmpty() && !openFile(f, static_cast<Side>(side), &error)) summary_->setText(error);
    });
  }
  summary_ = new QLabel(tr("`hydrahead eval --task niah-grid` and `--task ppl` write these files; the eval.h5 of "
                           "`hydrahead demo` holds both models."),
                        this);
  summary_->setWordWrap(true);
  auto* lengths_row = new QHBoxLayout;
  lengths_row->addWidget(new QLabel(tr("NIAH lengths:"), this));
  lengths_row->addWidget(lengths_);
  lengths_row->addWidget(new QLabel(tr("Device:"), this));
  lengths_row->addWidget(device_);
  lengths_row->addStretch(1);
  auto* progress_row = new QHBoxLayout;
  progress_row->addWidget(progress_, 1);
  progress_row->addWidget(cancel_button_);
  auto* layout = new QVBoxLayout(this);
  layout->addLayout(lengths_row);
  layout->addLayout(grid, 1);
  layout->addLayout(progress_row);
  layout->addWidget(summary_);
  connect(cancel_button_, &QPushButton::clicked, this, &EvalView::cancel);
}

QString EvalView::device() const { return device_->currentText(); }

bool EvalView::setDevice(const QString& device) {
  const int i = device_->findText(device);
  if (i < 0) return false;
  device_->setCurrentIndex(i);
  return true;
}

QString EvalView::summaryLine() const { return summary_->text(); }

void EvalView::cancel() {
  if (!isEvaluating()) return;
  summary_->setText(tr("cancelling the evaluation of %1\u2026").arg(evaluating_));
  cancelling_ = true;
  interruptChild(*proc_);
}

void EvalView::onOutput() {
  pending_ += proc_->readAllStandardOutput();
  auto on_event = [this](const QJsonObject& e) {
    if (e.value(QStringLiteral("event")).toString() != QLatin1String("progress")) return;
    const int done = e.value(QStringLiteral("done")).toInt(), total = e.value(QStringLiteral("total")).toInt();
    progress_->setRange(0, std::max(1, total));
    progress_->setValue(done);
    summary_->setText(tr("evaluating %1 on %2: %3 of %4 prompts \u00b7 ETA %5")
                          .arg(evaluating_, device_->currentText())
                          .arg(done)
                          .arg(total)
                          .arg(formatSeconds(e.value(QStringLiteral("eta_s")).toDouble(-1))));
    Q_EMIT progressed(done, total);
  };
  takeEventLines(pending_, on_event, [this](const QString& line) { last_line_ = line; });
}

EvalView::~EvalView() {
  // QProcess's destructor kills an evaluation still running, among this widget's children and after the
  // buttons and labels its finished() handler touches are gone: that end must not reach this view.
  if (proc_) proc_->disconnect(this);
}

bool EvalView::evaluate(const QString& model_dir, Side side, const QString& lengths, int n, QString* error) {
  if (isEvaluating()) {
    if (error) *error = tr("an evaluation is running");
    return false;
  }
  if (!QFileInfo::exists(model_dir + QStringLiteral("/config.json"))) {
    if (error) *error = tr("%1: not a checkpoint folder (no config.json)").arg(model_dir);
    return false;
  }
  model_edit_[side]->setText(model_dir);
  const QString out = out_dir_.filePath(QStringLiteral("niah-%1-%2.h5").arg(side).arg(QDateTime::currentMSecsSinceEpoch()));
  delete proc_;
  proc_ = new QProcess(this);
  proc_->setProcessChannelMode(QProcess::MergedChannels);
  pending_.clear();
  last_line_.clear();
  evaluating_ = model_dir;
  cancelling_ = false;
  auto running = [this](bool on) {
    for (QPushButton* b : run_buttons_) b->setEnabled(!on);
    device_->setEnabled(!on);
    cancel_button_->setEnabled(on);
    progress_->setVisible(on);
  };
  running(true);
  progress_->setRange(0, 1);
  progress_->setValue(0);
  summary_->setText(tr("evaluating %1 on %2\u2026").arg(model_dir, device_->currentText()));
  connect(proc_, &QProcess::readyReadStandardOutput, this, &EvalView::onOutput);
  connect(proc_, &QProcess::finished, this, [this, side, out, running](int code, QProcess::ExitStatus status) {
    onOutput();
    running(false);
    if (!pending_.trimmed().isEmpty()) last_line_ = QString::fromLocal8Bit(pending_.trimmed());
    QString error;
    // Cancelled: exit 130 once it stops between prompts, or the signal itself while the model still loads
    // (one that finished meanwhile is shown).
    const bool finished = status == QProcess::NormalExit && code == 0;
    if (!finished && (cancelling_ || (status == QProcess::NormalExit && code == 130))) {
      error = tr("the evaluation of %1 was cancelled; nothing was written").arg(evaluating_);
    } else if (status != QProcess::NormalExit || code != 0) {
      error = last_line_.isEmpty() ? tr("hydrahead eval exited with status %1").arg(code) : last_line_;
    } else if (openFile(out, side, &error)) {
      Q_EMIT evaluated(side);
      return;
    }
    summary_->setText(error);
    Q_EMIT failed(error);
  });
  connect(proc_, &QProcess::errorOccurred, this, [this, running](QProcess::ProcessError e) {
    if (e != QProcess::FailedToStart) return;
    running(false);
    const QString why = tr("could not start %1").arg(program_);
    summary_->setText(why);
    Q_EMIT failed(why);
  });
  proc_->start(program_, {QStringLiteral("eval"), QStringLiteral("--model"), model_dir, QStringLiteral("--task"),
                          QStringLiteral("niah-grid"), QStringLiteral("--lengths"), lengths, QStringLiteral("--n"),
                          QString::number(n), QStringLiteral("--device"), device_->currentText(),
                          QStringLiteral("--progress"), QStringLiteral("json"), QStringLiteral("--out"), out});
  return true;
}

bool EvalView::openFile(const QString& path, Side side, QString* error) {
  std::optional<NiahGrid> g[2];
  std::optional<double> p[2];
  bool both = false;
  try {
    const io::H5File f = io::H5File::open_read(toPath(path));
    both = f.exists("/teacher") && f.exists("/hybrid");
    if (both) {
      readModel(f, "/teacher", &g[Teacher], &p[Teacher]);
      readModel(f, "/hybrid", &g[Hybrid], &p[Hybrid]);
    } else {
      readModel(f, "", &g[side], &p[side]);
      if (!g[side] && !p[side]) throw Error(path.toStdString() + ": holds no /niah grid and no /ppl (not an eval.h5)");
    }
  } catch (const std::exception& e) {
    if (error) *error = QString::fromStdString(e.what());
    return false;
  }
  for (int s = 0; s < 2; ++s) {
    if (!both && s != side) continue;
    if (g[s]) grids_[s] = g[s];
    if (p[s]) ppl_[s] = p[s];
    files_[s] = QFileInfo(path).fileName();
    redraw(static_cast<Side>(s));
  }
  summary_->setText(summaryText());
  return true;
}

QString EvalView::summaryText() const {
  QStringList parts;
  const QString names[2] = {tr("teacher"), tr("hybrid")};
  for (int s = 0; s < 2; ++s) {
    QString part = names[s] + QStringLiteral(": ");
    part += grids_[s] ? tr("NIAH %1").arg(grids_[s]->mean(), 0, 'f', 3) : tr("NIAH -");
    part += ppl_[s] ? tr(", perplexity %1").arg(*ppl_[s], 0, 'f', 2) : QString();
    parts << part;
  }
  return parts.join(QStringLiteral(" \u00b7 "));
}

void EvalView::redraw(Side side) {
  QCustomPlot* plot = plots_[side];
  plot->clearPlottables();
  plot->clearItems();
  if (plot->plotLayout()->elementCount() > 1) plot->plotLayout()->removeAt(1);
  const QString name = side == Teacher ? tr("Teacher") : tr("Hybrid");
  titles_[side]->setText(tr("%1 (%2)%3").arg(name, files_[side],
                                             ppl_[side] ? tr(" \u00b7 perplexity %1").arg(*ppl_[side], 0, 'f', 2) : QString()));
  if (!grids_[side]) {
    plot->replot();
    return;
  }
  const NiahGrid& g = *grids_[side];
  const int nl = static_cast<int>(g.lengths.size()), nd = static_cast<int>(g.depths.size());
  auto* map = new QCPColorMap(plot->xAxis, plot->yAxis);
  map->data()->setSize(nd, nl);
  map->data()->setRange(QCPRange(0, std::max(0, nd - 1)), QCPRange(0, std::max(0, nl - 1)));
  for (int i = 0; i < nl; ++i)
    for (int j = 0; j < nd; ++j) {
      const double a = g.accuracy[static_cast<size_t>(i * nd + j)];
      map->data()->setCell(j, i, a);
      auto* label = new QCPItemText(plot);
      label->position->setCoords(j, i);
      label->setText(QString::number(a, 'f', 2));
      label->setColor(a < 0.5 ? Qt::white : Qt::black);
    }
  QCPColorGradient grad;
  grad.setColorStopAt(0.0, QColor(120, 20, 30));
  grad.setColorStopAt(0.5, QColor(240, 190, 80));
  grad.setColorStopAt(1.0, QColor(40, 140, 80));
  map->setGradient(grad);
  map->setDataRange(QCPRange(0, 1));
  map->setInterpolate(false);
  auto* scale = new QCPColorScale(plot);
  plot->plotLayout()->addElement(0, 1, scale);
  map->setColorScale(scale);
  scale->axis()->setLabel(tr("exact match"));
  QSharedPointer<QCPAxisTickerText> xt(new QCPAxisTickerText), yt(new QCPAxisTickerText);
  for (int j = 0; j < nd; ++j) xt->addTick(j, QString::number(g.depths[static_cast<size_t>(j)], 'g', 3));
  for (int i = 0; i < nl; ++i) yt->addTick(i, QString::number(g.lengths[static_cast<size_t>(i)]));
  plot->xAxis->setTicker(xt);
  plot->yAxis->setTicker(yt);
  plot->xAxis->setLabel(tr("needle depth"));
  plot->yAxis->setLabel(tr("context tokens"));
  plot->xAxis->setRange(-0.5, nd - 0.5);
  plot->yAxis->setRange(-0.5, nl - 0.5);
  plot->replot();
}

}  // namespace hh::workbench
