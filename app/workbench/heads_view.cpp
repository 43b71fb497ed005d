#include "heads_view.h"

#include <torch/torch.h>

#include <QComboBox>
#include <QtConcurrent/QtConcurrentRun>
#include <QFile>
#include <QFileInfo>
#include <QHBoxLayout>
#include <QHeaderView>
#include <QLabel>
#include <QMouseEvent>
#include <QPushButton>
#include <QSpinBox>
#include <QSplitter>
#include <QTableWidget>
#include <QToolTip>
#include <QVBoxLayout>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include "qcustomplot_include.h"

#include "core/interp/calibration.h"
#include "core/interp/patching.h"
#include "core/model/tokenizer.h"
#include "core/model/transformer.h"
#include "core/io/h5.h"
#include "core/util/error.h"
#include "core/select/selection.h"
#include "export.h"
#include "head_selection.h"
#include "selection_panel.h"
#include "qt_util.h"

namespace hh::workbench {

namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// What each map means, for the caption under the selector.
QString describe(const QString& name) {
  if (name == QLatin1String("noising"))
    return HeadsView::tr("Activation patching, noising: share of the clean-vs-corrupt metric gap lost when this "
                         "head alone sees the corrupt run (1 = all of it)");
  if (name == QLatin1String("denoising"))
    return HeadsView::tr("Activation patching, denoising: share of the gap restored when this head alone sees the "
                         "clean run inside the corrupt one");
  if (name == QLatin1String("retrieval_noising"))
    return HeadsView::tr("Noising effect over the retrieval-task examples (NIAH family, passkey)");
  if (name == QLatin1String("reasoning_noising"))
    return HeadsView::tr("Noising effect over the other tasks' examples");
  if (name == QLatin1String("path"))
    return HeadsView::tr("Path patching: the head's direct effect on the logits, normalised like noising");
  if (name == QLatin1String("attribution"))
    return HeadsView::tr("Attribution patching: the first-order estimate of the noising effect");
  if (name == QLatin1String("retrieval_score"))
    return HeadsView::tr("Retrieval score: share of answer tokens whose predicting position attends most to that "
                         "token inside the needle");
  if (name == QLatin1String("composite"))
    return HeadsView::tr("Composite: the mean of rank-normalised retrieval noising, reasoning noising and path "
                         "effect (what `hydrahead select` ranks by default)");
  return name;
}

std::vector<double> toVector(const at::Tensor& t) {
  const at::Tensor c = t.to(at::kDouble).contiguous().view(-1);
  return {c.data_ptr<double>(), c.data_ptr<double>() + c.numel()};
}

QString formatValue(double v) { return std::isnan(v) ? HeadsView::tr("n/a") : QString::number(v, 'f', 4); }

}  // namespace

// What the attention panel needs from the analysis file's model, read once (on the worker thread).
struct AttentionInputs {
  std::unique_ptr<model::Transformer> model;
  std::unique_ptr<model::Tokenizer> tok;  // null when the model directory has no tokenizer.json
  std::vector<interp::CalibExample> calib;
};

// One head's attention on one example, computed on the worker thread.
struct AttentionResult {
  std::shared_ptr<const AttentionInputs> inputs;  // as read (null when reading failed)
  QString error;                                  // empty on success
  std::vector<double> rows;                       // [A x T] row-major
  int A = 0, T = 0;
  std::vector<std::pair<double, QString>> ticks;  // the most attended positions and their text
  QStringList notes;
};

namespace {

// `cancel` (raised when the view closes or opens another file) is read between the steps, before each of
// the model's tensors is read and at each layer of the forward: a cancelled request ends with
// Cancelled's message as its error.
std::shared_ptr<AttentionResult> computeAttention(std::shared_ptr<const AttentionInputs> inputs, const QString& model_path,
                                                  const QString& calib_path, int index, int layer, int head,
                                                  const std::atomic<bool>& cancel) {
  auto r = std::make_shared<AttentionResult>();
  const auto check = [&cancel] {
    if (cancel.load()) throw Cancelled();
  };
  try {
    if (!inputs) {
      auto in = std::make_shared<AttentionInputs>();
      const std::filesystem::path dir = toPath(model_path);
      in->model = std::make_unique<model::Transformer>(model::Transformer::load(dir, "cpu", "f32", &cancel));
      check();
      if (std::filesystem::exists(dir / "tokenizer.json"))
        in->tok = std::make_unique<model::Tokenizer>(model::Tokenizer::load(dir / "tokenizer.json"));
      check();
      in->calib = interp::read_calibration(toPath(calib_path), in->tok.get(), in->model->config().vocab_size);
      inputs = std::move(in);
    }
    check();
    r->inputs = inputs;
    const auto& calib = inputs->calib;
    if (index < 0 || index >= static_cast<int>(calib.size())) {
      r->error = HeadsView::tr("example %1 is not in the calibration set (%2 examples)").arg(index).arg(calib.size());
      return r;
    }
    const interp::PreparedExample ex = interp::prepare_example(calib[static_cast<size_t>(index)], *inputs->model,
                                                               interp::Metric::LogProb, "example " + std::to_string(index));
    const at::Tensor rows = interp::answer_attention(*inputs->model, ex, layer, head, &cancel).contiguous();
    r->A = static_cast<int>(rows.size(0));
    r->T = static_cast<int>(rows.size(1));
    r->rows.assign(rows.data_ptr<double>(), rows.data_ptr<double>() + rows.numel());
    // The most attended tokens (over all rows), with their text.
    const at::Tensor peak = rows.amax(0);
    const at::Tensor top = std::get<1>(peak.topk(std::min<int64_t>(6, r->T)));
    for (int64_t k = 0; k < top.numel(); ++k) {
      const int64_t pos = top[k].item<int64_t>();
      const int64_t id = ex.clean[0][pos].item<int64_t>();
      const QString text = inputs->tok ? QString::fromStdString(inputs->tok->decode({id})).trimmed() : QString::number(id);
      r->ticks.emplace_back(static_cast<double>(pos), text);
      r->notes << QStringLiteral("%1 \u201c%2\u201d %3").arg(pos).arg(text).arg(peak[pos].item<double>(), 0, 'f', 2);
    }
  } catch (const std::exception& e) {
    r->error = QString::fromStdString(e.what());
  }
  return r;
}

}  // namespace

HeadsView::HeadsView(HeadSelection* selection, QWidget* parent) : QWidget(parent), selection_(selection) {
  signal_box_ = new QComboBox(this);
  signal_box_->setSizeAdjustPolicy(QComboBox::AdjustToContents);  // filled when an analysis opens, after the first show
  signal_box_->setObjectName(QStringLiteral("signalBox"));
  signal_box_->setEnabled(false);
  caption_ = new QLabel(tr("Open an analysis.h5 (File \u203a Open Analysis\u2026) to see its per-head maps."), this);
  caption_->setWordWrap(true);
  auto* top = new QHBoxLayout;
  top->addWidget(new QLabel(tr("Signal:"), this));
  top->addWidget(signal_box_);
  top->addWidget(caption_, 1);

  plot_ = new QCustomPlot(this);
  plot_->setObjectName(QStringLiteral("headsPlot"));
  plot_->setMinimumSize(360, 280);
  plot_->setMouseTracking(true);
  map_ = new QCPColorMap(plot_->xAxis, plot_->yAxis);
  scale_ = new QCPColorScale(plot_);
  plot_->plotLayout()->addElement(0, 1, scale_);
  map_->setColorScale(scale_);
  QCPColorGradient diverging;  // blue - white - red, white at zero once the range is symmetric
  diverging.setColorStopAt(0.0, QColor(33, 102, 172));
  diverging.setColorStopAt(0.5, QColor(247, 247, 247));
  diverging.setColorStopAt(1.0, QColor(178, 24, 43));
  diverging.setNanHandling(QCPColorGradient::nhNanColor);
  diverging.setNanColor(QColor(190, 190, 190));
  map_->setGradient(diverging);
  map_->setInterpolate(false);
  plot_->xAxis->setLabel(tr("query head"));
  plot_->yAxis->setLabel(tr("layer"));
  plot_->yAxis->setRangeReversed(true);  // layer 0 at the top, as in the Model view's grid
  auto* margins = new QCPMarginGroup(plot_);
  plot_->axisRect()->setMarginGroup(QCP::msBottom | QCP::msTop, margins);
  scale_->setMarginGroup(QCP::msBottom | QCP::msTop, margins);
  connect(plot_, &QCustomPlot::mouseMove, this, &HeadsView::onMouseMove);
  addExportMenu(plot_);
  connect(plot_, &QCustomPlot::mousePress, this, &HeadsView::onMousePress);

  detail_title_ = new QLabel(tr("Click a head for its details."), this);
  detail_title_->setWordWrap(true);
  detail_table_ = new QTableWidget(0, 3, this);
  detail_table_->setObjectName(QStringLiteral("headDetail"));
  detail_table_->setHorizontalHeaderLabels({tr("signal"), tr("value"), tr("rank")});
  detail_table_->verticalHeader()->hide();
  detail_table_->setEditTriggers(QAbstractItemView::NoEditTriggers);
  detail_table_->horizontalHeader()->setStretchLastSection(true);
  example_table_ = new QTableWidget(0, 2, this);
  example_table_->setObjectName(QStringLiteral("headExamples"));
  example_table_->setHorizontalHeaderLabels({tr("example (task)"), tr("noising effect")});
  example_table_->verticalHeader()->hide();
  example_table_->setEditTriggers(QAbstractItemView::NoEditTriggers);
  example_table_->horizontalHeader()->setStretchLastSection(true);
  addExportMenu(detail_table_);
  addExportMenu(example_table_);
  panel_ = new SelectionPanel(selection_, this);
  // The side in three parts the user can resize: the selection, the clicked head's details, its attention.
  auto* side = new QSplitter(Qt::Vertical, this);
  side->setChildrenCollapsible(false);
  side->addWidget(panel_);
  auto* details = new QWidget(side);
  auto* details_layout = new QVBoxLayout(details);
  details_layout->setContentsMargins(0, 0, 0, 0);
  details_layout->addWidget(detail_title_);
  details_layout->addWidget(detail_table_, 1);
  details_layout->addWidget(new QLabel(tr("Per example:"), details));
  details_layout->addWidget(example_table_, 1);
  side->addWidget(details);
  auto* attention = new QWidget(side);
  auto* attention_layout = new QVBoxLayout(attention);
  attention_layout->setContentsMargins(0, 0, 0, 0);
  example_spin_ = new QSpinBox(attention);
  example_spin_->setRange(0, 0);
  example_spin_->setToolTip(tr("Calibration example whose attention is shown"));
  auto* attn_row = new QHBoxLayout;
  attn_row->addWidget(new QLabel(tr("Attention on example"), attention));
  attn_row->addWidget(example_spin_);
  auto* attn_button = new QPushButton(tr("Show"), attention);
  attn_button->setToolTip(tr("Run the analysed model on the example (it loads on first use); from then on every "
                             "clicked head shows its attention"));
  attn_row->addWidget(attn_button);
  attn_row->addStretch(1);
  attention_layout->addLayout(attn_row);
  attn_plot_ = new QCustomPlot(attention);
  attn_plot_->setObjectName(QStringLiteral("headAttention"));
  attn_plot_->setMinimumHeight(100);
  attn_plot_->yAxis->setLabel(tr("answer row"));
  attn_plot_->yAxis->setRangeReversed(true);
  addExportMenu(attn_plot_);
  attn_label_ = new QLabel(attention);
  attn_label_->setWordWrap(true);
  attention_layout->addWidget(attn_plot_, 1);
  attention_layout->addWidget(attn_label_);
  side->addWidget(attention);
  side->setStretchFactor(0, 3);
  side->setStretchFactor(1, 2);
  side->setStretchFactor(2, 2);
  side->setSizes({460, 160, 180});  // the selection's budget table whole at 800 pixels; drag to change
  auto show = [this] {
    QString error;
    if (detail_.first >= 0 && !showAttention(example_spin_->value(), &error)) attn_label_->setText(error);
  };
  connect(attn_button, &QPushButton::clicked, this, show);
  connect(example_spin_, qOverload<int>(&QSpinBox::valueChanged), this, [this, show] {
    if (attention_on_) show();
  });

  auto* split = new QSplitter(this);
  split->addWidget(plot_);
  split->addWidget(side);
  split->setStretchFactor(0, 3);
  split->setStretchFactor(1, 1);
  auto* layout = new QVBoxLayout(this);
  layout->addLayout(top);
  layout->addWidget(split, 1);

  connect(signal_box_, &QComboBox::currentTextChanged, this, [this] { redraw(); });
  connect(selection_, &HeadSelection::changed, this, &HeadsView::updateOutlines);
  connect(&attn_watcher_, &QFutureWatcher<std::shared_ptr<AttentionResult>>::finished, this, &HeadsView::onAttentionReady);
}

HeadsView::~HeadsView() {
  attn_cancel_->store(true);  // a model still being read stops at its next tensor
  attn_watcher_.waitForFinished();  // the worker holds only its own data; wait so that none outlives the view
}

bool HeadsView::openAnalysis(const QString& path, QString* error) {
  const std::filesystem::path p = toPath(path);
  std::map<QString, std::vector<double>> maps;
  QStringList order;
  std::vector<std::vector<double>> per_example;
  QStringList tasks;
  QString model_path, calib_path;
  int layers = 0, heads = 0, group = 1;
  auto loaded = std::make_unique<select::Signals>();
  try {
    select::Signals& s = *loaded;
    s = select::load_signals(p, select::default_retrieval_tasks());
    layers = static_cast<int>(s.num_layers);
    heads = static_cast<int>(s.num_heads);
    group = s.shape.num_kv_heads > 0 ? static_cast<int>(s.shape.num_heads / s.shape.num_kv_heads) : 1;
    for (const std::string& name : select::kSignalNames) {
      auto it = s.maps.find(name);
      if (it == s.maps.end()) continue;
      maps[QString::fromStdString(name)] = it->second;
      order << QString::fromStdString(name);
    }
    if (order.isEmpty()) throw std::runtime_error(p.string() + ": holds no per-head map");
    try {
      maps[QStringLiteral("composite")] = select::composite(s, select::default_weights()).score;
      order << QStringLiteral("composite");
    } catch (const std::exception&) {
      // None of the default signals is in the file: no composite to show.
    }
    const io::H5File f = io::H5File::open_read(p);
    if (f.has_attr("/", "model_path")) model_path = QString::fromStdString(f.attr_string("/", "model_path"));
    if (f.has_attr("/", "calib_path")) calib_path = QString::fromStdString(f.attr_string("/", "calib_path"));
    if (f.exists("/activation/noising/metric_patched")) {
      const at::Tensor mp = f.read("/activation/noising/metric_patched").to(at::kDouble);  // [N, L, Hq]
      const at::Tensor mc = f.read("/examples/metric_clean").to(at::kDouble);
      const at::Tensor mk = f.read("/examples/metric_corrupt").to(at::kDouble);
      for (const auto& t : f.read_strings("/examples/task")) tasks << QString::fromStdString(t);
      for (int64_t i = 0; i < mp.size(0); ++i)
        per_example.push_back(toVector(interp::normalise_effect(mp[i], mc[i].item<double>(), mk[i].item<double>(),
                                                                interp::Mode::Noising)));
    }
  } catch (const std::exception& e) {
    if (error) *error = QString::fromStdString(e.what());
    return false;
  }
  panel_->setSignals(nullptr);  // before the old signals go
  signals_ = std::move(loaded);
  path_ = QFileInfo(path).absoluteFilePath();
  inputs_.reset();
  next_request_.reset();
  ++generation_;  // a forward still running for the previous file is dropped when it ends
  attn_cancel_->store(true);  // and stops early; requests for this file get a flag of their own
  attn_cancel_ = std::make_shared<std::atomic<bool>>(false);
  attn_rows_.clear();
  attn_shape_ = {0, 0};
  attention_on_ = false;
  model_path_ = model_path;
  calib_path_ = calib_path;
  {
    const QSignalBlocker block(example_spin_);
    example_spin_->setRange(0, std::max(0, static_cast<int>(per_example_.size()) - 1));
    example_spin_->setValue(0);
  }
  layers_ = layers;
  heads_ = heads;
  group_ = std::max(1, group);
  maps_ = std::move(maps);
  order_ = order;
  per_example_ = std::move(per_example);
  example_tasks_ = tasks;
  detail_ = {-1, -1};
  detail_title_->setText(tr("Click a head for its details."));
  detail_table_->setRowCount(0);
  example_table_->setRowCount(0);
  selection_->setShape(layers_, heads_);

  {
    const QSignalBlocker block(signal_box_);
    signal_box_->clear();
    signal_box_->addItems(order_);
    const int preferred = order_.indexOf(QStringLiteral("composite"));
    signal_box_->setCurrentIndex(preferred >= 0 ? preferred : 0);
    signal_box_->setEnabled(true);
  }
  redraw();
  panel_->setSignals(signals_.get());  // applies the default strategy: the selection starts at 7:1
  Q_EMIT analysisOpened(path_);
  return true;
}

QStringList HeadsView::signalNames() const { return order_; }
QString HeadsView::currentSignal() const { return signal_box_->currentText(); }
void HeadsView::setSignal(const QString& name) { signal_box_->setCurrentText(name); }

const std::vector<double>* HeadsView::currentMap() const {
  auto it = maps_.find(currentSignal());
  return it == maps_.end() ? nullptr : &it->second;
}

double HeadsView::valueIn(const std::vector<double>* m, int layer, int head) const {
  if (!m || layer < 0 || layer >= layers_ || head < 0 || head >= heads_) return kNaN;
  return (*m)[static_cast<size_t>(layer * heads_ + head)];
}

int HeadsView::rankIn(const std::vector<double>* m, int layer, int head) const {
  const double v = valueIn(m, layer, head);
  if (std::isnan(v)) return 0;
  int above = 0;
  for (double x : *m)
    if (!std::isnan(x) && x > v) ++above;
  return above + 1;
}

double HeadsView::value(int layer, int head) const { return valueIn(currentMap(), layer, head); }
int HeadsView::rank(int layer, int head) const { return rankIn(currentMap(), layer, head); }

QString HeadsView::tooltipFor(int layer, int head) const {
  const int r = rank(layer, head);
  return tr("layer %1, head %2 (KV group %3)\n%4 = %5\nrank %6 of %7\n%8")
      .arg(layer)
      .arg(head)
      .arg(head / group_)
      .arg(currentSignal(), formatValue(value(layer, head)))
      .arg(r > 0 ? QString::number(r) : tr("-"))
      .arg(layers_ * heads_)
      .arg(selection_->isFullAttention(layer, head) ? tr("full attention (click: linear)")
                                                     : tr("linear attention (click: full)"));
}

void HeadsView::redraw() {
  const auto* m = currentMap();
  plot_->clearItems();
  outlines_.clear();
  if (!m) {
    map_->data()->clear();
    plot_->replot();
    return;
  }
  map_->data()->setSize(heads_, layers_);
  map_->data()->setRange(QCPRange(0, heads_ - 1), QCPRange(0, layers_ - 1));
  double lim = 0;
  for (int l = 0; l < layers_; ++l)
    for (int h = 0; h < heads_; ++h) {
      const double v = (*m)[static_cast<size_t>(l * heads_ + h)];
      map_->data()->setCell(h, l, v);
      if (!std::isnan(v)) lim = std::max(lim, std::abs(v));
    }
  if (lim <= 0) lim = 1;
  map_->setDataRange(QCPRange(-lim, lim));  // symmetric: zero is the white midpoint
  scale_->axis()->setLabel(currentSignal());
  plot_->xAxis->setRange(-0.5, heads_ - 0.5);
  plot_->yAxis->setRange(-0.5, layers_ - 0.5);
  QSharedPointer<QCPAxisTickerFixed> ticker(new QCPAxisTickerFixed);
  ticker->setTickStep(1);
  plot_->xAxis->setTicker(ticker);
  plot_->yAxis->setTicker(ticker);
  plot_->xAxis->grid()->setVisible(false);
  plot_->yAxis->grid()->setVisible(false);
  for (int g = 1; g * group_ < heads_; ++g) {
    auto* line = new QCPItemStraightLine(plot_);
    line->point1->setCoords(g * group_ - 0.5, 0);
    line->point2->setCoords(g * group_ - 0.5, 1);
    line->setPen(QPen(QColor(40, 40, 40), 1.5, Qt::DashLine));
  }
  caption_->setText(describe(currentSignal()));
  updateOutlines();
}

void HeadsView::updateOutlines() {
  for (QCPItemRect* r : outlines_) plot_->removeItem(r);
  outlines_.clear();
  for (const auto& [l, h] : selection_->faHeads()) {
    auto* r = new QCPItemRect(plot_);
    r->topLeft->setCoords(h - 0.45, l - 0.45);
    r->bottomRight->setCoords(h + 0.45, l + 0.45);
    r->setPen(QPen(Qt::black, 2.5));
    r->setBrush(Qt::NoBrush);
    outlines_.push_back(r);
  }
  plot_->replot();
}

QPoint HeadsView::cellCenter(int layer, int head) const {
  return QPoint(static_cast<int>(std::lround(plot_->xAxis->coordToPixel(head))),
                static_cast<int>(std::lround(plot_->yAxis->coordToPixel(layer))));
}

bool HeadsView::cellAt(const QPoint& pos, int* layer, int* head) const {
  if (layers_ == 0 || !plot_->axisRect()->rect().contains(pos)) return false;
  const int h = static_cast<int>(std::lround(plot_->xAxis->pixelToCoord(pos.x())));
  const int l = static_cast<int>(std::lround(plot_->yAxis->pixelToCoord(pos.y())));
  if (l < 0 || l >= layers_ || h < 0 || h >= heads_) return false;
  *layer = l;
  *head = h;
  return true;
}

void HeadsView::onMouseMove(QMouseEvent* event) {
  int l = 0, h = 0;
  if (cellAt(event->pos(), &l, &h)) QToolTip::showText(event->globalPosition().toPoint(), tooltipFor(l, h), plot_);
  else QToolTip::hideText();
}

void HeadsView::onMousePress(QMouseEvent* event) {
  int l = 0, h = 0;
  if (event->button() != Qt::LeftButton || !cellAt(event->pos(), &l, &h)) return;
  selection_->toggle(l, h);
  showDetail(l, h);
  Q_EMIT headClicked(l, h);
}

void HeadsView::showDetail(int layer, int head) {
  detail_ = {layer, head};
  detail_title_->setText(tr("Layer %1, head %2 \u00b7 KV group %3 \u00b7 %4")
                             .arg(layer)
                             .arg(head)
                             .arg(head / group_)
                             .arg(selection_->isFullAttention(layer, head) ? tr("full attention")
                                                                            : tr("linear attention")));
  detail_table_->setRowCount(static_cast<int>(order_.size()));
  for (int i = 0; i < order_.size(); ++i) {
    const std::vector<double>* m = &maps_.at(order_[i]);
    const int r = rankIn(m, layer, head);
    detail_table_->setItem(i, 0, new QTableWidgetItem(order_[i]));
    detail_table_->setItem(i, 1, new QTableWidgetItem(formatValue(valueIn(m, layer, head))));
    detail_table_->setItem(i, 2, new QTableWidgetItem(r > 0 ? QString::number(r) : tr("-")));
  }
  if (attention_on_) {  // a forward pass: only once the user has asked for attention
    QString error;
    if (!showAttention(example_spin_->value(), &error)) attn_label_->setText(error);
  }
  example_table_->setRowCount(static_cast<int>(per_example_.size()));
  for (size_t i = 0; i < per_example_.size(); ++i) {
    const QString task = i < static_cast<size_t>(example_tasks_.size()) ? example_tasks_[static_cast<int>(i)] : QString();
    const double v = per_example_[i][static_cast<size_t>(layer * heads_ + head)];
    example_table_->setItem(static_cast<int>(i), 0, new QTableWidgetItem(QStringLiteral("%1 (%2)").arg(i).arg(task)));
    example_table_->setItem(static_cast<int>(i), 1, new QTableWidgetItem(formatValue(v)));
  }
}

QString HeadsView::attentionText() const { return attn_label_->text(); }

bool HeadsView::showAttention(int index, QString* error) {
  auto fail = [error](const QString& why) {
    if (error) *error = why;
    return false;
  };
  if (detail_.first < 0) return fail(tr("click a head first"));
  attention_on_ = true;
  if (model_path_.isEmpty() || calib_path_.isEmpty())
    return fail(tr("%1 does not name its model and calibration set").arg(path_));
  if (inputs_ && (index < 0 || index >= static_cast<int>(inputs_->calib.size())))
    return fail(tr("example %1 is not in the calibration set (%2 examples)").arg(index).arg(inputs_->calib.size()));
  startAttention({index, detail_.first, detail_.second, generation_});
  return true;
}

bool HeadsView::attentionBusy() const { return attn_running_ || next_request_.has_value(); }

void HeadsView::startAttention(const AttentionRequest& r) {
  attn_label_->setText(tr("Computing head %1:%2 on example %3%4")
                           .arg(r.layer)
                           .arg(r.head)
                           .arg(r.index)
                           .arg(inputs_ ? QStringLiteral("...") : tr(" (reading the model first)...")));
  if (attn_running_) {
    next_request_ = r;  // the newest request waits; older ones are dropped
    return;
  }
  const std::shared_ptr<const AttentionInputs> inputs = inputs_;
  const QString model_path = model_path_, calib_path = calib_path_;
  const std::shared_ptr<const std::atomic<bool>> cancel = attn_cancel_;
  pending_ = r;
  attn_running_ = true;
  attn_watcher_.setFuture(QtConcurrent::run([inputs, model_path, calib_path, r, cancel] {
    return computeAttention(inputs, model_path, calib_path, r.index, r.layer, r.head, *cancel);
  }));
}

void HeadsView::onAttentionReady() {
  const std::shared_ptr<AttentionResult> res = attn_watcher_.result();
  const AttentionRequest done = pending_;
  attn_running_ = false;
  if (done.generation != generation_) {  // made for a file no longer open
    if (next_request_) {
      const AttentionRequest r = *next_request_;
      next_request_.reset();
      startAttention(r);
    }
    return;
  }
  if (res->inputs) inputs_ = res->inputs;
  if (next_request_) {  // a newer request: run it rather than show this one
    const AttentionRequest r = *next_request_;
    next_request_.reset();
    startAttention(r);
    return;
  }
  if (!res->error.isEmpty()) {
    attn_label_->setText(res->error);
    Q_EMIT attentionShown();
    return;
  }
  {
    const QSignalBlocker block(example_spin_);  // the box names the example shown
    example_spin_->setMaximum(std::max(example_spin_->maximum(), static_cast<int>(inputs_->calib.size()) - 1));
    example_spin_->setValue(done.index);
  }
  const int A = res->A, T = res->T;
  attn_rows_ = res->rows;
  attn_shape_ = {A, T};
  attn_plot_->clearPlottables();
  if (attn_plot_->plotLayout()->elementCount() > 1) attn_plot_->plotLayout()->removeAt(1);
  auto* map = new QCPColorMap(attn_plot_->xAxis, attn_plot_->yAxis);
  map->data()->setSize(T, A);
  map->data()->setRange(QCPRange(0, T - 1), QCPRange(0, std::max(0, A - 1)));
  for (int i = 0; i < A; ++i)
    for (int t = 0; t < T; ++t) map->data()->setCell(t, i, attn_rows_[static_cast<size_t>(i * T + t)]);
  map->setGradient(QCPColorGradient::gpThermal);
  map->setDataRange(QCPRange(0, 1));
  map->setInterpolate(false);
  QSharedPointer<QCPAxisTickerText> ticker(new QCPAxisTickerText);
  for (const auto& [pos, text] : res->ticks) ticker->addTick(pos, text);
  attn_plot_->xAxis->setTicker(ticker);
  attn_plot_->xAxis->setTickLabelRotation(60);
  attn_plot_->xAxis->setRange(-0.5, T - 0.5);
  attn_plot_->yAxis->setRange(-0.5, A - 0.5);
  attn_plot_->replot();
  attn_label_->setText(tr("Head %1:%2 on example %3 (%4 tokens): most attended %5")
                           .arg(done.layer)
                           .arg(done.head)
                           .arg(done.index)
                           .arg(T)
                           .arg(res->notes.join(QStringLiteral(", "))));
  Q_EMIT attentionShown();
}

}  // namespace hh::workbench
