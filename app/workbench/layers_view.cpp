#include "layers_view.h"

#include <torch/torch.h>

#include <QComboBox>
#include <QDoubleSpinBox>
#include <QFile>
#include <QHBoxLayout>
#include <QLabel>
#include <QMouseEvent>
#include <QToolTip>
#include <QVBoxLayout>
#include <cmath>
#include <limits>

#include "core/interp/similarity.h"
#include "core/io/h5.h"
#include "export.h"
#include "qcustomplot_include.h"
#include "qt_util.h"

namespace hh::workbench {

namespace {

const char* const kMetrics[] = {"cosine_delta", "cka", "angular"};

QString describe(const QString& m) {
  if (m == QLatin1String("cosine_delta"))
    return LayersView::tr("cosine of the layers' updates to the residual stream (1 = the same direction)");
  if (m == QLatin1String("cka")) return LayersView::tr("linear CKA of the layers' outputs (1 = the same representation)");
  return LayersView::tr("angular distance of the layers' outputs (0 = the same direction); blocks use 1 - distance");
}

}  // namespace

LayersView::LayersView(QWidget* parent) : QWidget(parent) {
  metric_box_ = new QComboBox(this);
  metric_box_->setObjectName(QStringLiteral("metricBox"));
  threshold_ = new QDoubleSpinBox(this);
  threshold_->setObjectName(QStringLiteral("blockThreshold"));
  threshold_->setRange(0.0, 1.0);
  threshold_->setSingleStep(0.01);
  threshold_->setDecimals(3);
  threshold_->setValue(0.9);
  threshold_->setToolTip(tr("A block ends where the similarity of two neighbouring layers falls below this"));
  note_ = new QLabel(tr("Open an analysis.h5 with layer similarity (hydrahead analyze --method similarity)."), this);
  note_->setWordWrap(true);
  auto* top = new QHBoxLayout;
  top->addWidget(new QLabel(tr("Metric:"), this));
  top->addWidget(metric_box_);
  top->addWidget(new QLabel(tr("Block threshold:"), this));
  top->addWidget(threshold_);
  top->addWidget(note_, 1);

  plot_ = new QCustomPlot(this);
  plot_->setObjectName(QStringLiteral("layersPlot"));
  plot_->setMouseTracking(true);
  map_ = new QCPColorMap(plot_->xAxis, plot_->yAxis);
  auto* scale = new QCPColorScale(plot_);
  plot_->plotLayout()->addElement(0, 1, scale);
  map_->setColorScale(scale);
  QCPColorGradient g;  // sequential: dark = low, light = high
  g.setColorStopAt(0.0, QColor(68, 1, 84));
  g.setColorStopAt(0.5, QColor(33, 145, 140));
  g.setColorStopAt(1.0, QColor(253, 231, 37));
  g.setNanHandling(QCPColorGradient::nhNanColor);
  g.setNanColor(QColor(190, 190, 190));
  map_->setGradient(g);
  map_->setInterpolate(false);
  plot_->xAxis->setLabel(tr("layer"));
  plot_->yAxis->setLabel(tr("layer"));
  plot_->yAxis->setRangeReversed(true);
  auto* layout = new QVBoxLayout(this);
  layout->addLayout(top);
  layout->addWidget(plot_, 1);

  connect(metric_box_, &QComboBox::currentTextChanged, this, [this] { redraw(); });
  connect(threshold_, qOverload<double>(&QDoubleSpinBox::valueChanged), this, [this] { redraw(); });
  connect(plot_, &QCustomPlot::mouseMove, this, &LayersView::onMouseMove);
  addExportMenu(plot_);
}

bool LayersView::openAnalysis(const QString& path, QString* error) {
  std::map<QString, std::vector<double>> mats;
  int layers = 0;
  try {
    const io::H5File f = io::H5File::open_read(toPath(path));
    for (const char* name : kMetrics) {
      const std::string ds = std::string("/similarity/") + name;
      if (!f.exists(ds)) continue;
      const at::Tensor m = f.read(ds).to(at::kDouble).contiguous();
      if (m.dim() != 2 || m.size(0) != m.size(1))
        throw std::runtime_error(path.toStdString() + ": " + ds + " is not a square matrix");
      layers = static_cast<int>(m.size(0));
      mats[QString::fromLatin1(name)] = std::vector<double>(m.data_ptr<double>(), m.data_ptr<double>() + m.numel());
    }
  } catch (const std::exception& e) {
    if (error) *error = QString::fromStdString(e.what());
    return false;
  }
  mats_ = std::move(mats);
  layers_ = mats_.empty() ? 0 : layers;
  const QSignalBlocker block(metric_box_);
  metric_box_->clear();
  for (const char* name : kMetrics)
    if (mats_.count(QString::fromLatin1(name))) metric_box_->addItem(QString::fromLatin1(name));
  if (metric_box_->findText(QStringLiteral("cka")) >= 0) metric_box_->setCurrentText(QStringLiteral("cka"));
  redraw();
  return true;
}

QStringList LayersView::metrics() const {
  QStringList out;
  for (int i = 0; i < metric_box_->count(); ++i) out << metric_box_->itemText(i);
  return out;
}
QString LayersView::currentMetric() const { return metric_box_->currentText(); }
void LayersView::setMetric(const QString& name) { metric_box_->setCurrentText(name); }
double LayersView::threshold() const { return threshold_->value(); }
void LayersView::setThreshold(double t) { threshold_->setValue(t); }
QString LayersView::noteText() const { return note_->text(); }

double LayersView::value(int i, int j) const {
  auto it = mats_.find(currentMetric());
  if (it == mats_.end() || i < 0 || j < 0 || i >= layers_ || j >= layers_) return std::numeric_limits<double>::quiet_NaN();
  return it->second[static_cast<size_t>(i * layers_ + j)];
}

QString LayersView::blocksText() const {
  QStringList parts;
  for (const auto& [a, b] : blocks_) parts << (a == b ? QString::number(a) : QStringLiteral("%1\u2013%2").arg(a).arg(b));
  return parts.join(QStringLiteral(" | "));
}

void LayersView::redraw() {
  plot_->clearItems();
  blocks_.clear();
  auto it = mats_.find(currentMetric());
  if (it == mats_.end()) {
    map_->data()->clear();
    note_->setText(tr("This analysis has no layer similarity (hydrahead analyze --method similarity)."));
    plot_->replot();
    return;
  }
  const int L = layers_;
  map_->data()->setSize(L, L);
  map_->data()->setRange(QCPRange(0, L - 1), QCPRange(0, L - 1));
  double lo = 0, hi = 1;
  for (int i = 0; i < L; ++i)
    for (int j = 0; j < L; ++j) {
      const double v = it->second[static_cast<size_t>(i * L + j)];
      map_->data()->setCell(j, i, v);
      if (!std::isnan(v)) {
        lo = std::min(lo, v);
        hi = std::max(hi, v);
      }
    }
  map_->setDataRange(QCPRange(lo, hi));
  map_->colorScale()->axis()->setLabel(currentMetric());
  plot_->xAxis->setRange(-0.5, L - 0.5);
  plot_->yAxis->setRange(-0.5, L - 0.5);
  QSharedPointer<QCPAxisTickerFixed> ticker(new QCPAxisTickerFixed);
  ticker->setTickStep(1);
  plot_->xAxis->setTicker(ticker);
  plot_->yAxis->setTicker(ticker);

  const at::Tensor m = at::from_blob(it->second.data(), {L, L}, at::TensorOptions().dtype(at::kDouble)).clone();
  for (const auto& [a, b] : interp::similarity_blocks(m, threshold(), currentMetric() == QLatin1String("angular"))) {
    blocks_.push_back({static_cast<int>(a), static_cast<int>(b)});
    auto* r = new QCPItemRect(plot_);
    r->topLeft->setCoords(a - 0.5, a - 0.5);
    r->bottomRight->setCoords(b + 0.5, b + 0.5);
    r->setPen(QPen(Qt::white, 3));
    r->setBrush(Qt::NoBrush);
  }
  note_->setText(tr("%1. Blocks at %2: %3").arg(describe(currentMetric())).arg(threshold(), 0, 'f', 3).arg(blocksText()));
  plot_->replot();
}

void LayersView::onMouseMove(QMouseEvent* event) {
  if (layers_ == 0 || !plot_->axisRect()->rect().contains(event->pos())) return;
  const int j = static_cast<int>(std::lround(plot_->xAxis->pixelToCoord(event->pos().x())));
  const int i = static_cast<int>(std::lround(plot_->yAxis->pixelToCoord(event->pos().y())));
  const double v = value(i, j);
  if (std::isnan(v)) return;
  QToolTip::showText(event->globalPosition().toPoint(),
                     tr("layers %1 and %2\n%3 = %4").arg(i).arg(j).arg(currentMetric()).arg(v, 0, 'f', 4), plot_);
}

}  // namespace hh::workbench
