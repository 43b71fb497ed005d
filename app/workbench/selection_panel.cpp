#include "selection_panel.h"

#include <QComboBox>
#include <QFile>
#include <QFormLayout>
#include <QHBoxLayout>
#include <QHeaderView>
#include <QLabel>
#include <QLineEdit>
#include <QSlider>
#include <QSpinBox>
#include <QScrollBar>
#include <QTableWidget>
#include <QVBoxLayout>
#include <set>

#include "core/select/selection.h"
#include "export.h"
#include "head_selection.h"
#include "hydrahead/version.h"
#include "qt_util.h"

namespace hh::workbench {

namespace {

std::set<HeadRef> toSet(const std::vector<select::Head>& heads) {
  std::set<HeadRef> out;
  for (const auto& [l, h] : heads) out.insert({static_cast<int>(l), static_cast<int>(h)});
  return out;
}

const QStringList kStrategyChoices = {QStringLiteral("global"), QStringLiteral("per-layer"), QStringLiteral("kv-group"),
                                      QStringLiteral("layerwise"), QStringLiteral("random")};

}  // namespace

SelectionPanel::SelectionPanel(HeadSelection* selection, QWidget* parent) : QWidget(parent), selection_(selection) {
  ratio_slider_ = new QSlider(Qt::Horizontal, this);
  ratio_slider_->setObjectName(QStringLiteral("ratioSlider"));
  ratio_slider_->setRange(1, 31);
  ratio_slider_->setValue(7);
  ratio_label_ = new QLabel(QStringLiteral("7:1"), this);
  ratio_label_->setMinimumWidth(40);
  auto* ratio_row = new QHBoxLayout;
  ratio_row->addWidget(ratio_slider_, 1);
  ratio_row->addWidget(ratio_label_);
  strategy_box_ = new QComboBox(this);
  strategy_box_->addItems(kStrategyChoices);
  strategy_box_->setToolTip(tr("global: top heads by composite score; per-layer: equal quota per layer; kv-group: "
                               "whole GQA groups; layerwise: every (r+1)-th layer in full; random: seeded baseline"));
  min_per_layer_ = new QSpinBox(this);
  min_per_layer_->setRange(0, 64);
  seed_ = new QSpinBox(this);
  seed_->setRange(0, 1000000);
  weights_ = new QLineEdit(this);
  weights_->setPlaceholderText(QStringLiteral("retrieval_noising=1,reasoning_noising=1,path=1"));
  weights_->setToolTip(tr("Signal weights of the composite score, NAME=WEIGHT,...; empty = the default"));
  auto* form = new QFormLayout;
  form->addRow(tr("LA:FA ratio"), ratio_row);
  form->addRow(tr("Strategy"), strategy_box_);
  form->addRow(tr("Min per layer"), min_per_layer_);
  form->addRow(tr("Seed"), seed_);
  form->addRow(tr("Weights"), weights_);

  count_ = new QLabel(this);
  count_->setObjectName(QStringLiteral("faCount"));
  count_->setWordWrap(true);
  overlap_ = new QLabel(this);
  overlap_->setWordWrap(true);
  budget_ = new QTableWidget(0, 6, this);
  budget_->setObjectName(QStringLiteral("budgetTable"));
  budget_->setHorizontalHeaderLabels({tr("context"), tr("configuration"), tr("FA heads"), tr("KV cache"),
                                      tr("GDN state"), tr("attn TFLOP")});
  budget_->verticalHeader()->hide();
  budget_->setEditTriggers(QAbstractItemView::NoEditTriggers);
  budget_->horizontalHeader()->setSectionResizeMode(QHeaderView::ResizeToContents);
  addExportMenu(budget_);
  // Room for one context's rows (dense, layer-wise, random, this selection) without scrolling down, beside a
  // horizontal scroll bar (the panel is narrower than the table).
  budget_->setMinimumHeight(budget_->horizontalHeader()->sizeHint().height() +
                            4 * budget_->verticalHeader()->defaultSectionSize() +
                            budget_->horizontalScrollBar()->sizeHint().height() + 2 * budget_->frameWidth());

  auto* layout = new QVBoxLayout(this);
  layout->setContentsMargins(0, 0, 0, 0);
  layout->addLayout(form);
  layout->addWidget(count_);
  layout->addWidget(overlap_);
  layout->addWidget(budget_, 1);
  setEnabled(false);

  connect(ratio_slider_, &QSlider::valueChanged, this, [this](int r) {
    ratio_label_->setText(QStringLiteral("%1:1").arg(r));
    if (ratio_slider_->isSliderDown()) {  // dragging: preview the count, apply on release
      if (signals_)
        count_->setText(tr("%1 full-attention heads at %2:1 (release to apply)")
                            .arg(select::fa_count(signals_->shape, r))
                            .arg(r));
      return;
    }
    apply();
  });
  connect(ratio_slider_, &QSlider::sliderReleased, this, &SelectionPanel::apply);
  connect(strategy_box_, &QComboBox::currentTextChanged, this, &SelectionPanel::apply);
  connect(min_per_layer_, qOverload<int>(&QSpinBox::valueChanged), this, &SelectionPanel::apply);
  connect(seed_, qOverload<int>(&QSpinBox::valueChanged), this, &SelectionPanel::apply);
  connect(weights_, &QLineEdit::editingFinished, this, &SelectionPanel::apply);
  connect(selection_, &HeadSelection::changed, this, &SelectionPanel::refresh);
}

SelectionPanel::~SelectionPanel() = default;

void SelectionPanel::setSignals(const select::Signals* signals) {
  signals_ = signals;
  applied_.reset();
  {
    const QSignalBlocker b1(ratio_slider_), b2(strategy_box_), b3(min_per_layer_), b4(seed_), b5(weights_);
    ratio_slider_->setValue(7);
    ratio_label_->setText(QStringLiteral("7:1"));
    strategy_box_->setCurrentText(QStringLiteral("global"));
    min_per_layer_->setValue(0);
    seed_->setValue(0);
    weights_->clear();
  }
  setEnabled(signals_ != nullptr);
  if (signals_) apply();
  else refresh();
}

int SelectionPanel::ratio() const { return ratio_slider_->value(); }
void SelectionPanel::setRatio(int r) { ratio_slider_->setValue(r); }
QString SelectionPanel::strategy() const { return strategy_box_->currentText(); }
void SelectionPanel::setStrategy(const QString& s) { strategy_box_->setCurrentText(s); }
void SelectionPanel::setMinPerLayer(int n) { min_per_layer_->setValue(n); }
void SelectionPanel::setSeed(int seed) { seed_->setValue(seed); }
void SelectionPanel::setWeights(const QString& spec) {
  weights_->setText(spec);
  apply();
}
QString SelectionPanel::countText() const { return count_->text(); }

std::unique_ptr<select::SelectionReport> SelectionPanel::report(bool manual) const {
  select::SelectOptions o;
  o.strategy = manual ? "manual" : strategy().toStdString();
  o.ratio = ratio();
  o.min_per_layer = min_per_layer_->value();
  o.seed = static_cast<uint64_t>(seed_->value());
  if (manual)
    for (const auto& [l, h] : selection_->faHeads()) o.manual.push_back({l, h});
  const auto weights = select::parse_weights(weights_->text().toStdString());
  return std::make_unique<select::SelectionReport>(select::make_selection(
      signals_->shape, signals_, weights, o, true, 2, std::string("hydrahead-workbench ") + HYDRAHEAD_VERSION));
}

void SelectionPanel::apply() {
  if (!signals_ || applying_) return;
  applying_ = true;
  try {
    applied_ = report(false);
    error_.clear();
    selection_->replace(toSet(applied_->heads), tr("%1 at %2:1").arg(strategy()).arg(ratio()));
  } catch (const std::exception& e) {
    error_ = QString::fromStdString(e.what());
  }
  applying_ = false;
  refresh();
}

void SelectionPanel::refresh() {
  if (!signals_) {
    count_->setText(tr("Open an analysis to choose heads."));
    overlap_->clear();
    budget_->setRowCount(0);
    return;
  }
  if (!error_.isEmpty()) {
    count_->setText(tr("Cannot apply: %1").arg(error_));
    return;
  }
  const bool manual = !applied_ || toSet(applied_->heads) != selection_->faHeads();
  std::unique_ptr<select::SelectionReport> r;
  try {
    r = manual ? report(true) : nullptr;
  } catch (const std::exception& e) {
    count_->setText(tr("Cannot apply: %1").arg(QString::fromStdString(e.what())));
    return;
  }
  const select::SelectionReport& shown = manual ? *r : *applied_;
  const int total = static_cast<int>(signals_->shape.num_layers * signals_->shape.num_heads);
  count_->setText(tr("%1 of %2 heads in full attention (%3; %4:1 asks for %5)")
                      .arg(selection_->count())
                      .arg(total)
                      .arg(manual ? tr("edited by hand") : strategy())
                      .arg(ratio())
                      .arg(select::fa_count(signals_->shape, ratio())));
  overlap_->setText(tr("Overlap (Jaccard) with layer-wise %1:1: %2 \u00b7 with random (seed %3): %4")
                        .arg(ratio())
                        .arg(shown.layerwise_jaccard, 0, 'f', 3)
                        .arg(seed_->value())
                        .arg(shown.random_jaccard, 0, 'f', 3) +
                    (shown.notes.empty() ? QString() : QStringLiteral("\n") + QString::fromStdString(shown.notes.front())));
  budget_->setRowCount(static_cast<int>(shown.budget.size()));
  for (int i = 0; i < static_cast<int>(shown.budget.size()); ++i) {
    const auto& row = shown.budget[static_cast<size_t>(i)];
    const auto& b = row.budget;
    const QStringList cells = {QStringLiteral("%1K").arg(b.context / 1024), QString::fromStdString(row.configuration),
                               QString::number(b.fa_heads), humanBytes(b.kv_bytes), humanBytes(b.state_bytes),
                               QString::number(b.attn_flops / 1e12, 'f', 1)};
    for (int c = 0; c < cells.size(); ++c) budget_->setItem(i, c, new QTableWidgetItem(cells[c]));
  }
}

bool SelectionPanel::exportManifest(const QString& path) {
  if (!signals_) {
    export_error_ = tr("no analysis is open");
    return false;
  }
  try {
    const bool manual = !applied_ || toSet(applied_->heads) != selection_->faHeads();
    auto r = report(manual);
    select::write_manifest(toPath(path), r->manifest);
  } catch (const std::exception& e) {
    export_error_ = QString::fromStdString(e.what());
    return false;
  }
  export_error_.clear();
  return true;
}

}  // namespace hh::workbench
