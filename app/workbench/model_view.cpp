#include "model_view.h"

#include <QApplication>
#include <QClipboard>
#include <QFontDatabase>
#include <QFormLayout>
#include <QGroupBox>
#include <QHBoxLayout>
#include <QHeaderView>
#include <QLabel>
#include <QLineEdit>
#include <QPushButton>
#include <QScrollArea>
#include <QSortFilterProxyModel>
#include <QSplitter>
#include <QStackedWidget>
#include <QStyle>
#include <QTabWidget>
#include <QTableView>
#include <QToolButton>
#include <QVBoxLayout>
#include <algorithm>
#include <cmath>

#include "head_grid_model.h"
#include "style_helpers.h"
#include "tensor_table_model.h"

namespace hh::workbench {
namespace {

constexpr int kHeadCellWidth = 34;    // px; fits "H31" and a two-digit group index
constexpr int kHeadCellHeight = 20;   // px; 28 layers (Qwen3-0.6B) fit an 800 px window
constexpr int kFormMinimumWidth = 400;
constexpr int kFormValueMinimumWidth = 180;  // px
constexpr int kFingerprintShownHex = 24;     // hex digits shown; the full value is in the tooltip and Copy
constexpr double kTitleScale = 1.4;   // model name relative to the base font
constexpr int kEmptyTextWidth = 440;  // px; line length of the empty page's hint

QString qs(const std::string& s) { return QString::fromStdString(s); }
QString grouped(int64_t n) { return qs(group_digits(n)); }

QString formatReal(double v) {
  // Integral values like rope_theta = 1000000 read better with digit groups than as 1e+06.
  if (std::isfinite(v) && v == std::floor(v) && std::fabs(v) < 1e15) return grouped(static_cast<int64_t>(v));
  return QString::number(v, 'g', 6);
}

QLabel* mutedLabel(const QString& text, QWidget* parent) {
  auto* label = new QLabel(text, parent);
  setMuted(label);
  return label;
}

}  // namespace

ModelView::ModelView(QWidget* parent) : QWidget(parent) {
  head_grid_ = new HeadGridModel(this);
  tensors_ = new TensorTableModel(this);
  tensor_proxy_ = new QSortFilterProxyModel(this);
  tensor_proxy_->setSourceModel(tensors_);
  tensor_proxy_->setSortRole(TensorTableModel::SortRole);
  tensor_proxy_->setFilterKeyColumn(TensorTableModel::NameColumn);
  tensor_proxy_->setFilterCaseSensitivity(Qt::CaseInsensitive);

  pages_ = new QStackedWidget(this);
  pages_->addWidget(buildEmptyPage());
  pages_->addWidget(buildContentPage());
  auto* layout = new QVBoxLayout(this);
  layout->setContentsMargins(0, 0, 0, 0);
  layout->addWidget(pages_);
  clear();
}

QWidget* ModelView::buildEmptyPage() {
  auto* page = new QWidget(this);
  auto* title = new QLabel(tr("No checkpoint open"), page);
  title->setFont(headingFont(title->font(), kTitleScale));
  title->setAlignment(Qt::AlignCenter);
  auto* text = mutedLabel(tr("Open a Hugging Face checkpoint folder (config.json and *.safetensors) with "
                             "File \u203a Open Checkpoint\u2026, or drop the folder onto this window."),
                          page);
  text->setWordWrap(true);
  text->setAlignment(Qt::AlignCenter);
  text->setMaximumWidth(kEmptyTextWidth);
  auto* button = new QPushButton(tr("Open Checkpoint\u2026"), page);
  button->setObjectName(QStringLiteral("openCheckpointButton"));
  connect(button, &QPushButton::clicked, this, &ModelView::openRequested);

  // Stretches rather than an alignment flag: an aligned word-wrapped label gets no height for its
  // second line.
  auto* centred = new QHBoxLayout;
  centred->addStretch(1);
  centred->addWidget(text, 100);
  centred->addStretch(1);

  auto* layout = new QVBoxLayout(page);
  layout->addStretch(2);
  layout->addWidget(title);
  layout->addSpacing(4);
  layout->addLayout(centred);
  layout->addSpacing(8);
  layout->addWidget(button, 0, Qt::AlignHCenter);
  layout->addStretch(3);
  return page;
}

QWidget* ModelView::buildContentPage() {
  auto* page = new QWidget(this);
  title_ = new QLabel(page);
  title_->setObjectName(QStringLiteral("modelTitle"));
  title_->setFont(headingFont(title_->font(), kTitleScale));
  title_->setTextInteractionFlags(Qt::TextSelectableByMouse);
  subtitle_ = mutedLabel(QString(), page);
  subtitle_->setTextInteractionFlags(Qt::TextSelectableByMouse);

  tabs_ = new QTabWidget(page);
  tabs_->setDocumentMode(true);
  tabs_->addTab(buildOverviewTab(), tr("Overview"));
  tabs_->addTab(buildTensorsTab(), tr("Tensors"));

  auto* layout = new QVBoxLayout(page);
  layout->setContentsMargins(12, 10, 12, 8);
  layout->setSpacing(2);
  layout->addWidget(title_);
  layout->addWidget(subtitle_);
  layout->addSpacing(8);
  layout->addWidget(tabs_, 1);
  return page;
}

QWidget* ModelView::buildOverviewTab() {
  auto* splitter = new QSplitter(Qt::Horizontal, this);
  splitter->setChildrenCollapsible(false);
  auto* scroll = new QScrollArea(splitter);
  scroll->setWidgetResizable(true);
  scroll->setFrameShape(QFrame::NoFrame);
  scroll->setHorizontalScrollBarPolicy(Qt::ScrollBarAlwaysOff);
  QWidget* form = buildConfigForm();
  scroll->setWidget(form);
  // Wide enough for the whole form next to a vertical scroll bar, so no row is ever cut off.
  const int form_width = std::max(kFormMinimumWidth, form->sizeHint().width() +
                                                         scroll->style()->pixelMetric(QStyle::PM_ScrollBarExtent));
  scroll->setMinimumWidth(form_width);
  splitter->addWidget(scroll);
  splitter->addWidget(buildHeadGridPanel());
  splitter->setStretchFactor(0, 0);
  splitter->setStretchFactor(1, 1);
  splitter->setSizes({form_width, 800});
  return splitter;
}

QLabel* ModelView::addField(QFormLayout* form, const QString& key, const QString& label, const QString& tooltip) {
  auto* value = new QLabel(form->parentWidget());
  value->setObjectName(QStringLiteral("field_") + key);
  value->setTextInteractionFlags(Qt::TextSelectableByMouse);
  value->setMinimumWidth(kFormValueMinimumWidth);
  auto* name = new QLabel(label, form->parentWidget());
  if (!tooltip.isEmpty()) name->setToolTip(tooltip);
  form->addRow(name, value);
  form_labels_.append(name);
  fields_.insert(key, value);
  return value;
}

QWidget* ModelView::buildConfigForm() {
  auto* panel = new QWidget(this);
  auto* layout = new QVBoxLayout(panel);
  layout->setContentsMargins(0, 8, 8, 0);
  auto newGroup = [&](const QString& title) {
    auto* box = new QGroupBox(title, panel);
    auto* form = new QFormLayout(box);
    form->setLabelAlignment(Qt::AlignRight);
    form->setFieldGrowthPolicy(QFormLayout::AllNonFixedFieldsGrow);
    form->setHorizontalSpacing(14);
    layout->addWidget(box);
    return form;
  };

  QFormLayout* arch = newGroup(tr("Architecture"));
  addField(arch, "architecture", tr("Architecture"), tr("architectures[0] and model_type in config.json"));
  addField(arch, "vocab_size", tr("Vocabulary"), tr("vocab_size"));
  addField(arch, "hidden_size", tr("Hidden size (d)"), tr("hidden_size"));
  addField(arch, "num_hidden_layers", tr("Layers (L)"), tr("num_hidden_layers"));
  addField(arch, "intermediate_size", tr("MLP intermediate"), tr("intermediate_size"));

  QFormLayout* attn = newGroup(tr("Attention"));
  addField(attn, "num_attention_heads", tr("Query heads (Hq)"), tr("num_attention_heads"));
  addField(attn, "num_key_value_heads", tr("KV heads (Hkv)"), tr("num_key_value_heads"));
  addField(attn, "head_dim", tr("Head dim (Dh)"), tr("head_dim"));
  addField(attn, "kv_group_size", tr("KV group size"), tr("query heads sharing one KV head: Hq / Hkv"));
  addField(attn, "rope_theta", tr("RoPE \u03b8"), tr("rope_theta"));

  QFormLayout* weights = newGroup(tr("Weights"));
  addField(weights, "rms_norm_eps", tr("RMSNorm \u03b5"), tr("rms_norm_eps"));
  addField(weights, "tie_word_embeddings", tr("Tied embeddings"), tr("tie_word_embeddings: lm_head reuses embed_tokens"));
  addField(weights, "dtype", tr("Stored dtype"), tr("dtype of the tensors in the safetensors files"));
  addField(weights, "parameters", tr("Parameters (config)"), tr("count implied by config.json"));
  {
    // The counted total sits beside a warning icon that appears when it disagrees with the config.
    auto* row = new QWidget(weights->parentWidget());
    auto* h = new QHBoxLayout(row);
    h->setContentsMargins(0, 0, 0, 0);
    h->setSpacing(6);
    param_warning_icon_ = new QLabel(row);
    const int icon = style()->pixelMetric(QStyle::PM_SmallIconSize);
    param_warning_icon_->setPixmap(style()->standardIcon(QStyle::SP_MessageBoxWarning).pixmap(icon, icon));
    param_warning_icon_->setObjectName(QStringLiteral("parameterWarningIcon"));
    auto* value = new QLabel(row);
    value->setObjectName(QStringLiteral("field_parameters_counted"));
    value->setTextInteractionFlags(Qt::TextSelectableByMouse);
    value->setWordWrap(true);
    h->addWidget(param_warning_icon_);
    h->addWidget(value, 1);
    auto* name = new QLabel(tr("Parameters (tensors)"), row);
    name->setToolTip(tr("sum of the element counts of the stored tensors"));
    weights->addRow(name, row);
    form_labels_.append(name);
    fields_.insert(QStringLiteral("parameters_counted"), value);
  }

  QFormLayout* ident = newGroup(tr("Identity"));
  {
    // The fingerprint is longer than the form is wide: a prefix is shown, Copy takes the whole value.
    auto* row = new QWidget(ident->parentWidget());
    auto* h = new QHBoxLayout(row);
    h->setContentsMargins(0, 0, 0, 0);
    auto* fp = new QLabel(row);
    fp->setObjectName(QStringLiteral("field_fingerprint"));
    fp->setFont(QFontDatabase::systemFont(QFontDatabase::FixedFont));
    fp->setTextInteractionFlags(Qt::TextSelectableByMouse);
    const QString sample = QStringLiteral("sha256:") + QString(kFingerprintShownHex, QLatin1Char('0')) + QChar(0x2026);
    fp->setMinimumWidth(fp->fontMetrics().horizontalAdvance(sample) + 2);
    auto* copy = new QToolButton(row);
    copy->setObjectName(QStringLiteral("copyFingerprint"));
    copy->setText(tr("Copy"));
    copy->setToolTip(tr("Copy the full fingerprint"));
    connect(copy, &QToolButton::clicked, this, [this] { QApplication::clipboard()->setText(fieldText("fingerprint")); });
    h->addWidget(fp, 1);
    h->addWidget(copy);
    auto* name = new QLabel(tr("Fingerprint"), ident->parentWidget());
    name->setToolTip(tr("sha256 over config.json and every safetensors header; analysis files and manifests "
                        "record it to name the model they belong to"));
    ident->addRow(name, row);
    form_labels_.append(name);
    fields_.insert(QStringLiteral("fingerprint"), fp);
  }
  QLabel* files = addField(ident, "files", tr("Weight files"));
  files->setWordWrap(true);

  // Each group has its own form layout; equal label widths line the value columns up across groups.
  int label_width = 0;
  for (const QLabel* l : form_labels_) label_width = std::max(label_width, l->sizeHint().width());
  for (QLabel* l : form_labels_) {
    l->setMinimumWidth(label_width);
    l->setAlignment(Qt::AlignRight | Qt::AlignVCenter);
  }

  layout->addStretch(1);
  return panel;
}

QWidget* ModelView::buildHeadGridPanel() {
  auto* box = new QGroupBox(tr("Query heads by layer"), this);
  head_legend_ = mutedLabel(QString(), box);
  head_legend_->setWordWrap(true);

  head_view_ = new QTableView(box);
  head_view_->setObjectName(QStringLiteral("headGrid"));
  head_view_->setModel(head_grid_);
  head_view_->setSelectionMode(QAbstractItemView::NoSelection);
  head_view_->setEditTriggers(QAbstractItemView::NoEditTriggers);
  head_view_->setSizeAdjustPolicy(QAbstractScrollArea::AdjustToContents);
  head_view_->setWordWrap(false);
  head_view_->horizontalHeader()->setSectionResizeMode(QHeaderView::Fixed);
  head_view_->horizontalHeader()->setDefaultSectionSize(kHeadCellWidth);
  head_view_->horizontalHeader()->setMinimumSectionSize(kHeadCellWidth);
  head_view_->verticalHeader()->setSectionResizeMode(QHeaderView::Fixed);
  head_view_->verticalHeader()->setDefaultSectionSize(kHeadCellHeight);
  head_view_->verticalHeader()->setMinimumSectionSize(kHeadCellHeight);
  head_view_->verticalHeader()->setDefaultAlignment(Qt::AlignCenter);

  auto* layout = new QVBoxLayout(box);
  layout->addWidget(head_legend_);
  layout->addWidget(head_view_, 1, Qt::AlignLeft | Qt::AlignTop);
  return box;
}

QWidget* ModelView::buildTensorsTab() {
  auto* page = new QWidget(this);
  tensor_filter_ = new QLineEdit(page);
  tensor_filter_->setObjectName(QStringLiteral("tensorFilter"));
  tensor_filter_->setPlaceholderText(tr("Filter by name\u2026"));
  tensor_filter_->setClearButtonEnabled(true);
  tensor_count_ = mutedLabel(QString(), page);
  connect(tensor_filter_, &QLineEdit::textChanged, this, [this](const QString& text) {
    tensor_proxy_->setFilterFixedString(text);
    updateTensorCount();
  });

  tensor_view_ = new QTableView(page);
  tensor_view_->setObjectName(QStringLiteral("tensorTable"));
  tensor_view_->setModel(tensor_proxy_);
  tensor_view_->setSortingEnabled(true);
  tensor_view_->sortByColumn(TensorTableModel::NameColumn, Qt::AscendingOrder);
  tensor_view_->setSelectionBehavior(QAbstractItemView::SelectRows);
  tensor_view_->setEditTriggers(QAbstractItemView::NoEditTriggers);
  tensor_view_->setAlternatingRowColors(true);
  tensor_view_->setShowGrid(false);
  tensor_view_->setWordWrap(false);
  tensor_view_->verticalHeader()->hide();
  tensor_view_->verticalHeader()->setDefaultSectionSize(tensor_view_->fontMetrics().height() + 6);
  auto* header = tensor_view_->horizontalHeader();
  header->setDefaultAlignment(Qt::AlignLeft | Qt::AlignVCenter);
  header->setSectionResizeMode(TensorTableModel::NameColumn, QHeaderView::Stretch);
  header->setSectionResizeMode(TensorTableModel::DTypeColumn, QHeaderView::ResizeToContents);
  header->setSectionResizeMode(TensorTableModel::ShapeColumn, QHeaderView::ResizeToContents);
  header->setSectionResizeMode(TensorTableModel::ElementsColumn, QHeaderView::ResizeToContents);

  auto* top = new QHBoxLayout;
  top->addWidget(tensor_filter_, 1);
  top->addWidget(tensor_count_);
  auto* layout = new QVBoxLayout(page);
  layout->setContentsMargins(0, 8, 0, 0);
  layout->addLayout(top);
  layout->addWidget(tensor_view_, 1);
  return page;
}

void ModelView::setField(const QString& key, const QString& text, const QString& tooltip) {
  QLabel* label = fields_.value(key);
  if (!label) return;
  QString shown = text;
  if (key == QLatin1String("fingerprint")) {
    const int cut = text.indexOf(QLatin1Char(':')) + 1 + kFingerprintShownHex;
    if (text.size() > cut) shown = text.left(cut) + QChar(0x2026);
  }
  label->setText(shown);
  label->setProperty("fullText", text);
  label->setToolTip(tooltip);
}

QString ModelView::fieldText(const QString& key) const {
  const QLabel* label = fields_.value(key);
  return label ? label->property("fullText").toString() : QString();
}

bool ModelView::parameterWarningShown() const { return !param_warning_icon_->isHidden(); }

void ModelView::setSummary(const ModelSummary& s) {
  summary_ = s;
  const auto& c = s.config;
  title_->setText(qs(s.name));
  subtitle_->setText(QString::fromStdString(s.dir.string()));

  setField("architecture", QStringLiteral("%1 (%2)").arg(qs(c.architecture), qs(c.model_type)));
  setField("vocab_size", grouped(c.vocab_size));
  setField("hidden_size", grouped(c.hidden_size));
  setField("num_hidden_layers", grouped(c.num_hidden_layers));
  setField("intermediate_size", grouped(c.intermediate_size));
  setField("num_attention_heads", grouped(c.num_attention_heads));
  setField("num_key_value_heads", grouped(c.num_key_value_heads));
  setField("head_dim", grouped(c.head_dim));
  const int64_t group = c.num_key_value_heads > 0 ? c.kv_group_size() : 0;
  setField("kv_group_size", group == 1 ? tr("1 (one KV head per query head)")
                                       : tr("%1 query heads per KV head").arg(group));
  setField("rope_theta", formatReal(c.rope_theta));
  setField("rms_norm_eps", QString::number(c.rms_norm_eps, 'g', 6));
  setField("tie_word_embeddings", c.tie_word_embeddings ? tr("yes") : tr("no"));
  setField("dtype", qs(s.weights_dtype), tr("config.json torch_dtype: %1").arg(qs(c.torch_dtype)));

  const QString from_config = qs(format_parameter_count(s.params_from_config));
  const QString from_tensors = qs(format_parameter_count(s.params_from_tensors));
  setField("parameters", from_config, tr("%1 parameters").arg(grouped(s.params_from_config)));
  if (s.params_match()) {
    setField("parameters_counted", tr("%1 (matches the config)").arg(from_tensors),
             tr("%1 parameters").arg(grouped(s.params_from_tensors)));
    param_warning_icon_->hide();
  } else {
    const int64_t diff = s.params_from_tensors - s.params_from_config;
    const QString signed_diff = (diff > 0 ? QStringLiteral("+") : QString()) + grouped(diff);
    setField("parameters_counted", tr("%1 \u2014 differs from the config by %2").arg(from_tensors, signed_diff),
             tr("The stored tensors hold %1 parameters; config.json implies %2. A missing, extra or "
                "reshaped tensor (or an lm_head stored despite tied embeddings) explains a difference.")
                 .arg(grouped(s.params_from_tensors), grouped(s.params_from_config)));
    param_warning_icon_->show();
  }
  setField("fingerprint", qs(s.fingerprint), qs(s.fingerprint));
  QStringList files;
  for (const auto& f : s.weight_files) files << qs(f);
  setField("files", files.size() <= 3 ? files.join(QStringLiteral(", "))
                                      : tr("%1 shards (%2 \u2026 %3)").arg(files.size()).arg(files.first(), files.last()),
           files.join(QLatin1Char('\n')));

  head_grid_->setShape(static_cast<int>(c.num_hidden_layers), static_cast<int>(c.num_attention_heads),
                       static_cast<int>(c.num_key_value_heads));
  fitHeadGrid();
  head_legend_->setText(tr("%1 layers \u00d7 %2 query heads. A cell shows the KV group its head reads "
                           "(h / %3); tints alternate between the %4 groups.")
                            .arg(c.num_hidden_layers)
                            .arg(c.num_attention_heads)
                            .arg(group)
                            .arg(c.num_key_value_heads));

  tensors_->setTensors(s.tensors);
  tensor_filter_->clear();
  tensor_view_->sortByColumn(TensorTableModel::NameColumn, Qt::AscendingOrder);
  updateTensorCount();
  tabs_->setTabText(1, tr("Tensors (%1)").arg(s.tensors.size()));
  pages_->setCurrentIndex(1);
}

void ModelView::clear() {
  summary_.reset();
  for (const QString& key : fields_.keys()) setField(key, QString());
  param_warning_icon_->hide();
  head_grid_->clear();
  tensors_->clear();
  tabs_->setTabText(1, tr("Tensors"));
  pages_->setCurrentIndex(0);
}

void ModelView::fitHeadGrid() {
  // Never larger than the grid itself (no blank band beside it); smaller sizes scroll.
  const int frame = 2 * head_view_->frameWidth();
  const QHeaderView* top = head_view_->horizontalHeader();
  const QHeaderView* left = head_view_->verticalHeader();
  const int width = left->sizeHint().width() + top->length() + frame;
  const int height = top->sizeHint().height() + left->length() + frame;
  head_view_->setMaximumSize(width, height);
}

void ModelView::updateTensorCount() {
  const int shown = tensor_proxy_->rowCount();
  const int total = tensors_->rowCount();
  tensor_count_->setText(shown == total ? tr("%1 tensors").arg(total) : tr("%1 of %2 tensors").arg(shown).arg(total));
}

}  // namespace hh::workbench
